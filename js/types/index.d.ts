// Types of @graphforge/ondevice. The onnxruntime namespace is structural, so that
// onnxruntime-node and onnxruntime-web both fit: Tensor and InferenceSession are theirs.
import type { InferenceSession, Tensor } from 'onnxruntime-common';

/** onnxruntime-node or onnxruntime-web (what `import * as ort from '...'` gives). */
export interface OrtNamespace {
  InferenceSession: { create(model: Uint8Array, options?: InferenceSession.SessionOptions): Promise<InferenceSession> };
  Tensor: typeof Tensor;
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
  state: { name: string; role: string; dtype: DType; shape: number[]; like: string | null }[];
  models: Record<'training' | 'eval' | 'optimizer' | 'train_step' | 'inference', { file: string; sha256: string; inputs: Port[]; outputs: Port[] }>;
}

export interface CreateOptions {
  ort: OrtNamespace;
  /** The artifact folder (path or URL): manifest.json and the files it names. */
  artifacts?: string | URL;
  checkpointState?: Source | CheckpointState;
  trainModel?: Source;
  evalModel?: Source;
  optimizerModel?: Source;
  trainStepModel?: Source;
  manifest?: Source | Manifest;
  /** Check every file against the manifest's sha256 (default true). */
  verify?: boolean;
}

export type Feeds = Record<string, Tensor>;

export class TrainingSession {
  static create(options: CreateOptions, sessionOptions?: InferenceSession.SessionOptions): Promise<TrainingSession>;
  readonly manifest: Manifest;
  readonly checkpointState: CheckpointState;
  readonly trainingInputNames: string[];
  readonly trainingOutputNames: string[];
  readonly evalInputNames: string[];
  readonly evalOutputNames: string[];
  runTrainStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  runOptimizerStep(): Promise<Record<string, Tensor>>;
  lazyResetGrad(): void;
  runEvalStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  /** One whole step in one session run (train_step.onnx). */
  runStep(feeds: Feeds): Promise<Record<string, Tensor>>;
  setLearningRate(lr: number): void;
  getLearningRate(): number;
  getParametersSize(trainableOnly?: boolean): number;
  getContiguousParameters(trainableOnly?: boolean): Promise<Tensor>;
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

export interface Schedule {
  readonly kind: string;
  lastStep: number;
  lrAt(step: number): number;
  step(): number;
  stateDict(): ScheduleState;
}

type Sink = { setLearningRate(lr: number): void; getLearningRate(): number } | null;
export class ConstantSchedule implements Schedule { constructor(session: Sink, options?: ScheduleOptions); readonly kind: string; lastStep: number; lrAt(step: number): number; step(): number; stateDict(): ScheduleState; }
export class LinearSchedule implements Schedule { constructor(session: Sink, options?: ScheduleOptions); readonly kind: string; lastStep: number; lrAt(step: number): number; step(): number; stateDict(): ScheduleState; }
export class PolynomialSchedule implements Schedule { constructor(session: Sink, options?: ScheduleOptions); readonly kind: string; lastStep: number; lrAt(step: number): number; step(): number; stateDict(): ScheduleState; }
export class CosineSchedule implements Schedule { constructor(session: Sink, options?: ScheduleOptions); readonly kind: string; lastStep: number; lrAt(step: number): number; step(): number; stateDict(): ScheduleState; }
export function makeSchedule(kind: 'constant' | 'linear' | 'polynomial' | 'cosine', session: Sink, options?: ScheduleOptions): Schedule;
export function scheduleFromState(state: ScheduleState, session: Sink): Schedule;

/** The uint32[2] key of one run's Dropout masks (graphforge's run_key). */
export function runKey(seed: number | bigint, step: number, microBatch: number, replica?: number): Uint32Array;
export function crc32(bytes: Uint8Array): number;
export function readManifest(source: Source, where: string): Promise<Manifest>;
export function checkManifest(document: unknown, where?: string): Manifest;
