// The declarations (types/index.d.ts) and the code (src/, checked with checkJs) describe one
// package: the same exports, and each export's public surface assignable both ways, so a member
// added, removed or retyped on one side alone fails `npm run typecheck`, naming it.
import type * as Code from '../src/index.js';
import type * as Declared from '../types/index.js';

/** The public members of T (a mapped type leaves out #private fields and construct signatures),
 * each method as its parameters and result: a parameter on one side only is then a difference
 * (a function of fewer parameters is assignable to one of more). */
type Public<T> = { [K in keyof T]: T[K] extends (...args: infer P) => infer R ? { parameters: P; result: R } : T[K] };
/** The same for the declared side. Two names, not one: TypeScript compares two instances of one
 * generic alias by its type arguments (a class with a method of fewer parameters passes). */
type DeclaredPublic<T> = { [K in keyof T]: T[K] extends (...args: infer P) => infer R ? { parameters: P; result: R } : T[K] };
type Statics<T> = Omit<T, 'prototype'>;
type Functions = 'makeSchedule' | 'scheduleFromState' | 'runKey' | 'crc32' | 'readManifest' | 'checkManifest';
type Create<T extends { create(...args: never[]): unknown }> = Parameters<T['create']>;

interface CodeSurface {
  exports: Record<keyof typeof Code, true>;
  functions: Public<Pick<typeof Code, Functions>>;
  CheckpointState: [Public<Statics<typeof Code.CheckpointState>>, Public<Code.CheckpointState>, ConstructorParameters<typeof Code.CheckpointState>];
  // create() resolves to an instance, whose #private fields only the code's class has
  TrainingSession: [Create<typeof Code.TrainingSession>, Public<Awaited<ReturnType<typeof Code.TrainingSession.create>>>, Public<Code.TrainingSession>];
  OndeviceError: Public<Code.OndeviceError>;
  schedules: [Public<Code.ConstantSchedule>, Public<Code.LinearSchedule>, Public<Code.PolynomialSchedule>, Public<Code.CosineSchedule>];
  scheduleOptions: ConstructorParameters<typeof Code.PolynomialSchedule>;
}

interface DeclaredSurface {
  exports: Record<keyof typeof Declared, true>;
  functions: DeclaredPublic<Pick<typeof Declared, Functions>>;
  CheckpointState: [DeclaredPublic<Statics<typeof Declared.CheckpointState>>, DeclaredPublic<Declared.CheckpointState>, ConstructorParameters<typeof Declared.CheckpointState>];
  TrainingSession: [Create<typeof Declared.TrainingSession>, DeclaredPublic<Awaited<ReturnType<typeof Declared.TrainingSession.create>>>, DeclaredPublic<Declared.TrainingSession>];
  OndeviceError: DeclaredPublic<Declared.OndeviceError>;
  schedules: [DeclaredPublic<Declared.ConstantSchedule>, DeclaredPublic<Declared.LinearSchedule>, DeclaredPublic<Declared.PolynomialSchedule>, DeclaredPublic<Declared.CosineSchedule>];
  scheduleOptions: ConstructorParameters<typeof Declared.PolynomialSchedule>;
}

declare const code: CodeSurface;
declare const declared: DeclaredSurface;
export const codeAsDeclared: DeclaredSurface = code;
export const declaredAsCode: CodeSurface = declared;
