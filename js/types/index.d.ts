// Types of @graphforge/ondevice. The onnxruntime namespace is structural, so that
// onnxruntime-node and onnxruntime-web both fit: Tensor and InferenceSession are theirs.
import type { InferenceSession, Tensor } from 'onnxruntime-common';

/** onnxruntime-node or onnxruntime-web (what `import * as ort from '...'` gives). */
export interface OrtNamespace {
  InferenceSession: { create(model: Uint8Array, options?: InferenceSession.SessionOptions): Promise<InferenceSession> };
  Tensor: typeof Tensor;
  /** onnxruntime's environment: `env.versions.web` tells onnxruntime-web's namespace. */
  env?: { versions?: { web?: string } };
}

/** A path (Node), a URL (fetched), or the bytes themselves. */
export type Source = string | URL | Uint8Array | ArrayBuffer;

export type DType = 'float32' | 'float64' | 'float16' | 'int64' | 'int32' | 'int16' | 'int8' | 'uint64' | 'uint32' | 'uint16' | 'uint8' | 'bool';
export type TypedArray =
  | Float32Array
  | Float64Array
  | Uint16Array
  | BigInt64Array
  | Int32Array
  | Int16Array
  | Int8Array
  | BigUint64Array
  | Uint32Array
  | Uint8Array;

export interface StoredTensor {
  dtype: DType;
  shape: number[];
  data: TypedArray;
}

export class OndeviceError extends Error {}

export class CheckpointState {
  constructor(init: {
    tensors: Map<string, StoredTensor>;
    roles?: Record<string, string>;
    step?: number;
    learningRate?: number | null;
    scheduler?: ScheduleState | null;
    seeds?: Record<string, number>;
    dataPosition?: unknown;
    properties?: Record<string, unknown>;
    gradResetPending?: boolean;
    microBatch?: number;
  });
  tensors: Map<string, StoredTensor>;
  roles: Record<string, string>;
  step: number;
  learningRate: number | null;
  scheduler: ScheduleState | null;
  seeds: Record<string, number>;
  /** Where the data loader stands (any JSON value). */
  dataPosition: unknown;
  properties: Record<string, unknown>;
  gradResetPending: boolean;
  microBatch: number;
  static fromBytes(bytes: Uint8Array | ArrayBuffer, where?: string): CheckpointState;
  static load(source: Source, where?: string): Promise<CheckpointState>;
  toBytes(): Uint8Array;
  /** Node only: written beside `path`, then renamed over it. */
  save(path: string): Promise<string>;
  tensor(name: string): StoredTensor;
}

export interface Port {
  name: string;
  dtype: DType;
  shape: (number | string | null)[] | null;
  role: 'batch' | 'labels' | 'state' | 'reset' | 'dropout_key' | 'lr' | 'step' | 'gradient' | 'loss' | 'output' | 'report';
  state?: string;
}

/** The models of an artifact folder, by key. */
export type ModelKey = 'training' | 'eval' | 'optimizer' | 'train_step' | 'train_steps' | 'inference';

export interface StateEntry {
  name: string;
  /** `frozen`: a parameter the models read and never update (a frozen base's). */
  role: 'parameter' | 'frozen' | 'optimizer' | 'accumulator' | 'buffer';
  dtype: DType;
  shape: number[];
  /** The parameter an optimizer state or accumulator belongs to. */
  like: string | null;
}

export interface ModelEntry {
  file: string;
  sha256: string;
  inputs: Port[];
  outputs: Port[];
}

export interface Manifest {
  format: 'graphforge.ondevice';
  version: number;
  graphforge: string;
  optimizer: { kind: string; hyperparameters: Record<string, unknown> };
  default_lr: number | null;
  accumulates: boolean;
  loss: string;
  labels: string | null;
  outputs: string[];
  dropout: { input: string; seed: number; key: 'splitmix64' } | null;
  checkpoint: { file: string; sha256: string };
  state: StateEntry[];
  models: Record<ModelKey, ModelEntry>;
}

export interface CreateOptions {
  ort: OrtNamespace;
  /** The artifact folder (path or URL): manifest.json and the files it names. */
  artifacts?: string | URL;
  /** The state to start from (default, with `artifacts`: the folder's checkpoint). */
  checkpointState?: Source | CheckpointState;
  /** training_model.onnx, where the files are given one by one. */
  trainModel?: Source;
  /** eval_model.onnx: what runEvalStep runs. */
  evalModel?: Source;
  /** optimizer_model.onnx. */
  optimizerModel?: Source;
  /** train_step.onnx: what runStep runs. */
  trainStepModel?: Source;
  /** train_steps.onnx: what runSteps runs (manifest version 2). */
  trainStepsModel?: Source;
  /** The manifest (default: the manifest.json beside trainModel). */
  manifest?: Source | Manifest;
  /** Check every file against the manifest's sha256 (default true). */
  verify?: boolean;
}

export type Feeds = Record<string, Tensor>;

export class TrainingSession {
  /** Every file is checked (present; its sha256, unless `verify` is false) before this resolves.
   * Without `sessionOptions.executionProviders` the sessions run on the backend of the namespace
   * given: onnxruntime-node's CPU (`['cpu']`), onnxruntime-web's wasm (`['wasm']`). */
  static create(options: CreateOptions, sessionOptions?: InferenceSession.SessionOptions): Promise<TrainingSession>;
  /** Made by `TrainingSession.create` only. */
  private constructor(token: symbol, made: unknown);
  readonly manifest: Manifest;
  readonly checkpointState: CheckpointState;
  readonly trainingInputNames: string[];
  readonly trainingOutputNames: string[];
  readonly evalInputNames: string[];
  readonly evalOutputNames: string[];
  /** The execution providers the sessions were made with, in onnxruntime's order of preference. */
  readonly executionProviders: string[];
  runTrainStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  runOptimizerStep(): Promise<Record<string, Tensor>>;
  lazyResetGrad(): void;
  runEvalStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  /** One whole step in one session run (train_step.onnx). */
  runStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  /** `k` whole steps in one session run (train_steps.onnx): each batch input stacked on a new
   * leading dim of `k`; the loss and reports come back as [k]. `learningRates`: the k steps'
   * rates (default: the current one for each; a schedule's: `schedule.nextRates(k)`). */
  runSteps(feeds: Feeds, k: number, options?: { learningRates?: number[] }): Promise<Record<string, Tensor>>;
  setLearningRate(lr: number): void;
  getLearningRate(): number;
  /** The elements of the trainable parameters, or (`trainableOnly` false) of every parameter, frozen ones too. */
  getParametersSize(trainableOnly?: boolean): number;
  /** The trainable parameters (every one: `trainableOnly` false) as one float32 tensor, in the manifest's order. */
  getContiguousParameters(trainableOnly?: boolean): Promise<Tensor>;
  /** Replace the trainable parameters (every one: `trainableOnly` false) with a buffer getContiguousParameters gave. */
  loadParametersBuffer(buffer: Uint8Array | Float32Array, trainableOnly?: boolean): Promise<void>;
  checkpointBytes(): Uint8Array;
  saveCheckpoint(path: string): Promise<string>;
  release(): Promise<void>;
}

export interface ScheduleOptions {
  baseLr?: number;
  warmupSteps?: number;
  warmupStartFactor?: number;
  totalSteps?: number | null;
  endLr?: number;
  lastStep?: number;
  power?: number;
}

export interface ScheduleState {
  kind: string;
  base_lr: number;
  warmup_steps: number;
  warmup_start_factor: number;
  total_steps: number | null;
  end_lr: number;
  last_step: number;
  power?: number;
}

export type ScheduleKind = 'constant' | 'linear' | 'polynomial' | 'cosine';

/** A learning-rate schedule: built on a session, it sets its rate at once and at each step(). */
export interface Schedule {
  readonly kind: ScheduleKind;
  readonly baseLr: number;
  readonly warmupSteps: number;
  readonly warmupStartFactor: number;
  readonly totalSteps: number | null;
  readonly endLr: number;
  /** Optimizer steps the schedule has advanced (the rate set is lrAt(lastStep)). */
  lastStep: number;
  /** The rate of optimizer step `step` (0-based). */
  lrAt(step: number): number;
  /** The rates of the next `k` optimizer steps, the schedule left where it is (for runSteps). */
  nextRates(k: number): number[];
  /** Advance one optimizer step; sets and returns the rate of the next one. */
  step(): number;
  stateDict(): ScheduleState;
}

/** What a schedule sets its rate on (a TrainingSession), or null. */
export type Sink = { setLearningRate(lr: number): void; getLearningRate(): number } | null;
declare class ScheduleBase implements Schedule {
  readonly kind: ScheduleKind;
  readonly baseLr: number;
  readonly warmupSteps: number;
  readonly warmupStartFactor: number;
  readonly totalSteps: number | null;
  readonly endLr: number;
  lastStep: number;
  lrAt(step: number): number;
  nextRates(k: number): number[];
  step(): number;
  stateDict(): ScheduleState;
}
export class ConstantSchedule extends ScheduleBase { constructor(session: Sink, options?: ScheduleOptions); }
export class LinearSchedule extends ScheduleBase { constructor(session: Sink, options?: ScheduleOptions); }
export class PolynomialSchedule extends ScheduleBase { constructor(session: Sink, options?: ScheduleOptions); readonly power: number; }
export class CosineSchedule extends ScheduleBase { constructor(session: Sink, options?: ScheduleOptions); }
export function makeSchedule(kind: ScheduleKind, session: Sink, options?: ScheduleOptions): Schedule;
export function scheduleFromState(state: ScheduleState, session: Sink): Schedule;

/** The uint32[2] key of one run's Dropout masks (graphforge's run_key). */
export function runKey(seed: number | bigint, step: number, microBatch: number, replica?: number): Uint32Array;
export function crc32(bytes: Uint8Array): number;
export function readManifest(source: Source, where: string): Promise<Manifest>;
export function checkManifest(document: unknown, where?: string): Manifest;

// only what is exported above is the package's (ScheduleBase is not)
export {};
