// A training session over graphforge's artifacts, with the surface of onnxruntime-web's
// TrainingSession (removed in 1.20): runTrainStep, runOptimizerStep, lazyResetGrad,
// runEvalStep, the contiguous parameters for federated averaging, release. It takes the
// onnxruntime namespace it runs on (onnxruntime-node or onnxruntime-web), so one code runs on
// both. The carried tensors live in a CheckpointState between runs; the manifest says which
// input each run reads and which output replaces it, so no ONNX metadata is read.
import { CheckpointState } from './checkpoint.js';
import { dtypeInfo, dtypeOfOrt, elementCount } from './dtypes.js';
import { runKey } from './dropout.js';
import { OndeviceError } from './errors.js';
import { missing, readBytes, resolveBeside } from './files.js';
import { checkHash, checkManifest, readManifest } from './manifest.js';

/**
 * @typedef {import('onnxruntime-common').InferenceSession} InferenceSession
 * @typedef {import('onnxruntime-common').InferenceSession.SessionOptions} SessionOptions
 * @typedef {import('onnxruntime-common').Tensor} Tensor
 * @typedef {import('../types/index.js').CreateOptions} CreateOptions
 * @typedef {import('../types/index.js').Feeds} Feeds
 * @typedef {import('../types/index.js').Manifest} Manifest
 * @typedef {import('../types/index.js').ModelKey} ModelKey
 * @typedef {import('../types/index.js').OrtNamespace} OrtNamespace
 * @typedef {import('../types/index.js').Port} Port
 * @typedef {import('../types/index.js').Source} Source
 * @typedef {Record<string, Tensor>} Outputs
 * @typedef {Partial<Record<ModelKey, Source>>} Models where each model comes from, by key
 */

const MANIFEST = 'manifest.json';
/** The option of create() that gives each model, for the errors that name it. */
/** The models a session reads at their first use, not at create() */
const READ_LATER = ['eval', 'train_step', 'train_steps'];
const OPTION = { training: 'trainModel', optimizer: 'optimizerModel', eval: 'evalModel', train_step: 'trainStepModel', train_steps: 'trainStepsModel' };
/** The inputs train_steps reads per step, stacked on its leading dim: the runtime makes them. */
const STACKED_SCALARS = ['reset', 'dropout_key', 'lr', 'step'];
/** Only create() makes a session: the constructor takes what it gathered. */
const CREATING = Symbol('TrainingSession.create');

export class TrainingSession {
  /** @type {OrtNamespace} */ #ort;
  /** @type {SessionOptions} */ #sessionOptions;
  /** @type {string} */ #where;
  /** @type {boolean} */ #verify;
  /** @type {Models} */ #sources;
  /** @type {Partial<Record<ModelKey, Promise<InferenceSession>>>} */ #sessions;
  #released = false;
  /** @type {Record<string, Tensor> | null} what a training run handed over, where the artifacts do not accumulate */
  #gradients = null;
  /** @type {string[]} */ #trainable;
  /** @type {string[]} */ #parameters;

  /**
   * Load a set of artifacts. ``options``: ``ort`` (the onnxruntime namespace), and either
   * ``artifacts`` (a folder path or URL holding manifest.json and the files it names) or
   * ``checkpointState``, ``trainModel``, ``optimizerModel`` (and ``evalModel``,
   * ``trainStepModel``), each a path, URL or bytes (the checkpoint may be a CheckpointState),
   * with ``manifest`` where the models are bytes (else the manifest.json beside ``trainModel``).
   * ``verify`` (default true) checks every file against the manifest's sha256. Every file is
   * there once this returns; the eval and whole-step models are read at their first run.
   * ``sessionOptions`` go to onnxruntime; without ``executionProviders`` the sessions run on the
   * backend of the namespace given: onnxruntime-node's CPU, onnxruntime-web's wasm.
   * @param {CreateOptions} options
   * @param {SessionOptions} [sessionOptions]
   * @returns {Promise<TrainingSession>}
   */
  static async create(options, sessionOptions = {}) {
    const ort = options?.ort;
    if (!ort?.InferenceSession || !ort?.Tensor) throw new OndeviceError('create({ort, ...}): give the onnxruntime namespace (onnxruntime-node or onnxruntime-web)');
    const verify = options.verify ?? true;
    const { manifest, where, sources, present } = await locate(options);
    const absent = (await Promise.all(present.map(async (source) => [source, await missing(source)]))).find(([, why]) => why);
    if (absent) throw new OndeviceError(`${String(absent[0])}: ${absent[1]} (the manifest lists it)`);
    const state = await checkpointOf(sources.checkpoint, manifest, verify);
    checkState(state, manifest, where);
    const executionProviders = providersFor(ort, sessionOptions);
    // the caller's providers go as given (with their options: a device id, a layout); else the namespace's backend
    const chosen = sessionOptions.executionProviders?.length || !executionProviders.length ? sessionOptions : { ...sessionOptions, executionProviders };
    /** @type {Partial<Record<ModelKey, Promise<InferenceSession>>>} */
    const sessions = {};
    try {
      for (const key of /** @type {const} */ (['training', 'optimizer'])) {
        const bytes = await modelBytes(manifest, key, /** @type {Source} */ (sources[key]), verify);
        sessions[key] = Promise.resolve(await ort.InferenceSession.create(bytes, chosen));
      }
    } catch (error) {
      for (const made of Object.values(sessions)) await (await made)?.release(); // the ones made before the failure
      throw error;
    }
    return new TrainingSession(CREATING, { ort, manifest, state, where, verify, sources, sessions, sessionOptions: chosen, executionProviders });
  }

  /**
   * Use TrainingSession.create(): it reads and checks the files, then makes the session.
   * @param {symbol} token
   * @param {{ort: OrtNamespace, manifest: Manifest, state: CheckpointState, where: string, verify: boolean, sources: Models,
   *   sessions: Partial<Record<ModelKey, Promise<InferenceSession>>>, sessionOptions: SessionOptions, executionProviders: string[]}} made
   */
  constructor(token, made) {
    if (token !== CREATING) throw new OndeviceError('make a TrainingSession with TrainingSession.create({ort, ...})');
    const { manifest, state } = made;
    this.#ort = made.ort;
    this.#where = made.where;
    this.#verify = made.verify;
    this.#sources = made.sources;
    this.#sessions = made.sessions;
    this.#sessionOptions = made.sessionOptions;
    /** @readonly */
    this.manifest = manifest;
    /** @readonly */
    this.checkpointState = state;
    /** The execution providers the sessions were made with, in onnxruntime's order of preference
     * (empty: onnxruntime's default for a namespace this runtime does not know). @readonly */
    this.executionProviders = made.executionProviders;
    if (state.learningRate === null || state.learningRate === undefined) state.learningRate = manifest.default_lr;
    /** @param {ModelKey} key */
    const users = (key) => (manifest.models[key]?.inputs ?? []).filter((p) => p.role === 'batch' || p.role === 'labels').map((p) => p.name);
    /** @readonly */
    this.trainingInputNames = users('training');
    /** @readonly */
    this.evalInputNames = users('eval');
    /** @readonly */
    this.trainingOutputNames = [manifest.loss, ...manifest.outputs];
    /** @readonly */
    this.evalOutputNames = [manifest.loss, ...manifest.outputs];
    this.#trainable = manifest.state.filter((s) => s.role === 'parameter').map((s) => s.name);
    this.#parameters = manifest.state.filter((s) => s.role === 'parameter' || s.role === 'frozen').map((s) => s.name);
  }

  // ------------------------------------------------------------------ steps

  /** Forward and backward on ``feeds`` (input name -> ort.Tensor): the gradients accumulate
   * until lazyResetGrad(). Returns the loss and the other outputs, by name.
   * @param {Feeds} feeds
   * @returns {Promise<Outputs>} */
  async runTrainStep(feeds) {
    if (!this.manifest.accumulates && this.#gradients) {
      throw new OndeviceError('these artifacts do not accumulate gradients: runOptimizerStep() after each runTrainStep() (write them from a program compiled with accumulate=true to accumulate)');
    }
    const outputs = await this.#run('training', feeds);
    const state = this.checkpointState;
    state.gradResetPending = false;
    state.microBatch += 1;
    if (!this.manifest.accumulates) this.#gradients = this.#ofRole('training', outputs, ['gradient']);
    return this.#ofRole('training', outputs, ['loss', 'output', 'report']);
  }

  /** The update with the accumulated gradients; counts the step. Returns its reports (grad_norm).
   * @returns {Promise<Outputs>} */
  async runOptimizerStep() {
    if (!this.manifest.accumulates && !this.#gradients) throw new OndeviceError('runOptimizerStep(): no gradients yet (runTrainStep first)');
    const outputs = await this.#run('optimizer', {});
    const state = this.checkpointState;
    state.step += 1;
    state.microBatch = 0;
    this.#gradients = null;
    return this.#ofRole('optimizer', outputs, ['loss', 'output', 'report']);
  }

  /** The next runTrainStep overwrites the accumulated gradients instead of adding to them. */
  lazyResetGrad() {
    this.checkpointState.gradResetPending = true;
  }

  /** Forward and loss in eval mode (Dropout off, BatchNorm on its running statistics).
   * @param {Feeds} feeds
   * @returns {Promise<Outputs>} */
  async runEvalStep(feeds) {
    return this.#ofRole('eval', await this.#run('eval', feeds), ['loss', 'output', 'report']);
  }

  /** One whole step in one run (train_step.onnx): forward, backward and update, where no
   * gradients wait from runTrainStep. The fast path when nothing accumulates.
   * @param {Feeds} feeds
   * @returns {Promise<Outputs>} */
  async runStep(feeds) {
    if (!this.checkpointState.gradResetPending && this.manifest.accumulates) {
      throw new OndeviceError('runStep() is a whole step: runOptimizerStep() for the gradients runTrainStep() accumulated first, or lazyResetGrad()');
    }
    const outputs = await this.#run('train_step', feeds);
    const state = this.checkpointState;
    state.step += 1;
    state.microBatch = 0;
    state.gradResetPending = true;
    return this.#ofRole('train_step', outputs, ['loss', 'output', 'report']);
  }

  /** ``k`` whole steps in one run (train_steps.onnx, the steps pass): each batch input of
   * ``feeds`` stacked on a new leading dim of ``k``, step i training on slice i. ``learningRates``:
   * the k steps' rates (default: the current one for each; a schedule's next k:
   * ``schedule.nextRates(k)``, then ``schedule.step()`` k times). The step count advances by k and
   * each step draws its own dropout masks: k runStep calls compute the same, bit for bit. Returns
   * the loss and the reports, [k] each.
   * @param {Feeds} feeds
   * @param {number} k
   * @param {{learningRates?: number[]}} [options]
   * @returns {Promise<Outputs>} */
  async runSteps(feeds, k, options = {}) {
    if (!Number.isInteger(k) || k < 1) throw new OndeviceError(`runSteps(feeds, k): k must be a whole number ≥ 1, got ${k}`);
    if (!this.checkpointState.gradResetPending && this.manifest.accumulates) {
      throw new OndeviceError('runSteps() after runTrainStep() accumulated gradients (accumulation across runs): runOptimizerStep() first, or lazyResetGrad()');
    }
    const rates = options.learningRates ?? Array.from({ length: k }, () => this.getLearningRate());
    if (rates.length !== k || rates.some((r) => typeof r !== 'number' || !Number.isFinite(r) || r < 0)) {
      throw new OndeviceError(`runSteps: learningRates takes the ${k} steps' rates, finite and ≥ 0; got [${rates}]`);
    }
    const outputs = await this.#run('train_steps', feeds, { k, rates });
    const state = this.checkpointState;
    state.step += k;
    state.microBatch = 0;
    state.gradResetPending = true;
    return this.#ofRole('train_steps', outputs, ['loss', 'report']);
  }

  // ------------------------------------------------------------------ the rate, the parameters, the state

  /** @param {number} lr */
  setLearningRate(lr) {
    if (typeof lr !== 'number' || !Number.isFinite(lr) || lr < 0) throw new OndeviceError(`the learning rate must be a finite number ≥ 0, got ${lr}`);
    this.checkpointState.learningRate = lr;
  }

  /** @returns {number} */
  getLearningRate() {
    return /** @type {number} */ (this.checkpointState.learningRate);
  }

  /** How many elements the trainable parameters hold together (with the frozen ones: ``trainableOnly`` false).
   * @param {boolean} [trainableOnly] */
  getParametersSize(trainableOnly = true) {
    return this.#names(trainableOnly).reduce((n, name) => n + elementCount(this.checkpointState.tensor(name).shape), 0);
  }

  /** The trainable parameters (with the frozen ones: ``trainableOnly`` false) in one float32
   * tensor, in the manifest's order: what federated averaging sends.
   * @param {boolean} [trainableOnly]
   * @returns {Promise<Tensor>} */
  async getContiguousParameters(trainableOnly = true) {
    const out = new Float32Array(this.getParametersSize(trainableOnly));
    let at = 0;
    for (const name of this.#names(trainableOnly)) {
      const t = this.checkpointState.tensor(name);
      if (!(t.data instanceof Float32Array)) throw new OndeviceError(`parameter '${name}' is ${t.dtype}: the contiguous parameters are float32`);
      out.set(t.data, at);
      at += t.data.length;
    }
    return new this.#ort.Tensor('float32', out, [out.length]);
  }

  /** Replace the trainable parameters (with the frozen ones: ``trainableOnly`` false) with
   * ``buffer``: the bytes of getContiguousParameters' data, or a Float32Array.
   * @param {Uint8Array | Float32Array} buffer
   * @param {boolean} [trainableOnly] */
  async loadParametersBuffer(buffer, trainableOnly = true) {
    const values = buffer instanceof Float32Array ? buffer : toFloat32(buffer);
    const size = this.getParametersSize(trainableOnly);
    if (values.length !== size) {
      const which = trainableOnly ? 'trainable parameters' : 'parameters';
      throw new OndeviceError(`loadParametersBuffer: the ${which} hold ${size} float32 values (${size * 4} bytes), the buffer ${values.length} (${values.length * 4} bytes)`);
    }
    let at = 0;
    for (const name of this.#names(trainableOnly)) {
      const t = this.checkpointState.tensor(name);
      t.data = values.slice(at, at + t.data.length);
      at += t.data.length;
    }
  }

  /** The state as checkpoint bytes (graphforge in Python loads them: CheckpointState.load). */
  checkpointBytes() {
    return this.checkpointState.toBytes();
  }

  /** Write the state to ``path`` at once (Node).
   * @param {string} path */
  async saveCheckpoint(path) {
    return this.checkpointState.save(path);
  }

  async release() {
    const made = Object.values(this.#sessions);
    this.#sessions = {};
    this.#released = true;
    for (const session of await Promise.allSettled(made)) if (session.status === 'fulfilled') await session.value.release();
  }

  // ------------------------------------------------------------------ running one model

  /** @param {boolean} trainableOnly */
  #names(trainableOnly) {
    return trainableOnly ? this.#trainable : this.#parameters;
  }

  /** The session of model ``key``, made at its first use (eval, the whole step).
   * @param {ModelKey} key
   * @returns {Promise<InferenceSession>} */
  #session(key) {
    if (this.#released) throw new OndeviceError('this TrainingSession was released: create another to train or evaluate');
    let made = this.#sessions[key];
    if (!made) {
      const source = this.#sources[key];
      if (source === undefined) {
        const file = this.manifest.models[key]?.file ?? `${key}.onnx`;
        const what = key === 'train_step' ? 'whole-step' : key === 'train_steps' ? 'k-steps' : key;
        const older = key === 'train_steps' && !this.manifest.models[key] ? ' (artifacts written before manifest version 2 have none: write them again)' : '';
        throw new OndeviceError(`no ${what} model: give ${OPTION[/** @type {keyof typeof OPTION} */ (key)] ?? key} (${file}) to create(), or artifacts (the folder that holds it)${older}`);
      }
      made = modelBytes(this.manifest, key, source, this.#verify).then((bytes) => this.#ort.InferenceSession.create(bytes, this.#sessionOptions));
      made.catch(() => delete this.#sessions[key]); // a failed load is tried again at the next run
      this.#sessions[key] = made;
    }
    return made;
  }

  /** Run model ``key`` on ``feeds`` and the state; the state outputs replace their tensors.
   * @param {ModelKey} key
   * @param {Feeds} feeds
   * @param {{k: number, rates: number[]} | null} [steps] train_steps: how many, at which rates
   * @returns {Promise<Outputs>} */
  async #run(key, feeds, steps = null) {
    const entry = this.manifest.models[key];
    const inputs = steps ? this.#stackedFeeds(key, feeds, steps) : this.#feedsFor(key, feeds);
    const session = await this.#session(key);
    const outputs = await session.run(inputs);
    const state = this.checkpointState;
    for (const port of entry.outputs) {
      if (port.role === 'state') state.tensor(/** @type {string} */ (port.state)).data = /** @type {import('../types/index.js').TypedArray} */ (outputs[port.name].data);
    }
    return outputs;
  }

  /** Every input of model ``key``: the batch from ``feeds`` (checked), the rest from the state.
   * @param {ModelKey} key
   * @param {Feeds} feeds
   * @param {Manifest} [manifest] the manifest whose model ``key`` says which inputs (default: the session's)
   * @returns {Feeds} */
  #feedsFor(key, feeds, manifest = this.manifest) {
    const entry = manifest.models[key];
    const ort = this.#ort;
    const state = this.checkpointState;
    /** @type {Feeds} */
    const inputs = {};
    /** @type {Record<string, number>} */
    const dims = {};
    for (const port of entry.inputs) {
      switch (port.role) {
        case 'batch':
        case 'labels':
          inputs[port.name] = checkedFeed(feeds, port, dims, key);
          break;
        case 'state': {
          const t = state.tensor(/** @type {string} */ (port.state));
          inputs[port.name] = new ort.Tensor(/** @type {any} */ (dtypeInfo(t.dtype).ort), /** @type {any} */ (t.data), t.shape);
          break;
        }
        case 'reset':
          inputs[port.name] = new ort.Tensor('bool', new Uint8Array([key === 'train_step' ? 1 : state.gradResetPending ? 1 : 0]), []);
          break;
        case 'dropout_key': {
          const seed = this.manifest.dropout?.seed ?? 0;
          inputs[port.name] = new ort.Tensor('uint32', runKey(state.seeds.dropout ?? seed, state.step, state.microBatch), [2]);
          break;
        }
        case 'lr':
          inputs[port.name] = new ort.Tensor('float32', new Float32Array([this.getLearningRate()]), []);
          break;
        case 'step':
          inputs[port.name] = new ort.Tensor('int64', new BigInt64Array([BigInt(state.step)]), []);
          break;
        case 'gradient':
          inputs[port.name] = /** @type {Record<string, Tensor>} */ (this.#gradients)[port.name];
          break;
        default:
          throw new OndeviceError(`${this.#where}: input '${port.name}' of the ${key} model has the role '${port.role}', which this runtime does not know`);
      }
    }
    const unknown = Object.keys(feeds).filter((n) => !entry.inputs.some((p) => p.name === n && (p.role === 'batch' || p.role === 'labels')));
    if (unknown.length) {
      const known = entry.inputs.filter((p) => p.role === 'batch' || p.role === 'labels').map((p) => p.name);
      throw new OndeviceError(`the ${key} model has no input '${unknown[0]}'; it takes: ${known.join(', ')}`);
    }
    return inputs;
  }

  /** The inputs of train_steps: the stacked batch (its leading dim ``k``), and each step's
   * reset flag, dropout key, rate and step count stacked as the steps run them.
   * @param {ModelKey} key
   * @param {Feeds} feeds
   * @param {{k: number, rates: number[]}} steps
   * @returns {Feeds} */
  #stackedFeeds(key, feeds, { k, rates }) {
    const entry = this.manifest.models[key];
    const ort = this.#ort;
    const state = this.checkpointState;
    const stacked = entry.inputs.filter((p) => STACKED_SCALARS.includes(p.role));
    const unstacked = { ...this.manifest, models: { ...this.manifest.models, [key]: { ...entry, inputs: entry.inputs.filter((p) => !STACKED_SCALARS.includes(p.role)) } } };
    const inputs = this.#feedsFor(key, feeds, unstacked);
    for (const port of entry.inputs.filter((p) => p.role === 'batch' || p.role === 'labels')) {
      if (inputs[port.name].dims[0] !== k) {
        throw new OndeviceError(`runSteps(feeds, ${k}): input '${port.name}' has ${inputs[port.name].dims[0]} steps stacked on its leading dim [${inputs[port.name].dims}] (data that is not stacked?)`);
      }
    }
    const seed = state.seeds.dropout ?? this.manifest.dropout?.seed ?? 0;
    for (const port of stacked) {
      if (port.role === 'reset') inputs[port.name] = new ort.Tensor('bool', new Uint8Array(k).fill(1), [k]);
      if (port.role === 'lr') inputs[port.name] = new ort.Tensor('float32', Float32Array.from(rates), [k]);
      if (port.role === 'step') inputs[port.name] = new ort.Tensor('int64', BigInt64Array.from({ length: k }, (_, i) => BigInt(state.step + i)), [k]);
      if (port.role === 'dropout_key') {
        const keys = new Uint32Array(2 * k);
        for (let i = 0; i < k; i++) keys.set(runKey(seed, state.step + i, 0), 2 * i);
        inputs[port.name] = new ort.Tensor('uint32', keys, [k, 2]);
      }
    }
    return inputs;
  }

  /** The outputs of model ``key`` whose role is one of ``roles``.
   * @param {ModelKey} key
   * @param {Outputs} outputs
   * @param {Port['role'][]} roles
   * @returns {Outputs} */
  #ofRole(key, outputs, roles) {
    /** @type {Outputs} */
    const chosen = {};
    for (const port of this.manifest.models[key].outputs) if (roles.includes(port.role)) chosen[port.name] = outputs[port.name];
    return chosen;
  }
}

/** A batch input of the feeds, checked against the manifest: present, of its dtype, of its
 * rank and fixed dims, and its symbolic dims the same wherever they are named.
 * @param {Feeds} feeds
 * @param {Port} port
 * @param {Record<string, number>} dims
 * @param {ModelKey} key
 * @returns {Tensor} */
function checkedFeed(feeds, port, dims, key) {
  const value = feeds[port.name];
  if (value === undefined) throw new OndeviceError(`the ${key} model needs input '${port.name}' (${port.dtype} [${port.shape}])`);
  if (!value || typeof value.type !== 'string' || !Array.isArray(value.dims)) {
    throw new OndeviceError(`input '${port.name}' must be an onnxruntime Tensor (new ort.Tensor(type, data, dims))`);
  }
  if (dtypeOfOrt(value.type) !== port.dtype) {
    throw new OndeviceError(`input '${port.name}' is ${value.type}, the ${key} model takes ${port.dtype}`);
  }
  const shape = port.shape;
  if (shape) {
    if (value.dims.length !== shape.length) {
      throw new OndeviceError(`input '${port.name}' has ${value.dims.length} dims [${value.dims}], the ${key} model takes ${shape.length} [${shape}]`);
    }
    shape.forEach((want, i) => {
      const got = value.dims[i];
      if (typeof want === 'number' && got !== want) {
        throw new OndeviceError(`input '${port.name}' has dim ${i} = ${got}, the ${key} model takes ${want} ([${shape}])`);
      }
      if (typeof want === 'string') {
        if (dims[want] !== undefined && dims[want] !== got) {
          throw new OndeviceError(`input '${port.name}' has ${want} = ${got}, another input ${dims[want]}: they must agree`);
        }
        dims[want] = got;
      }
    });
  }
  return value;
}

/** Where each file of the artifacts comes from, the manifest, and the files to find present
 * now that are read only later (the eval and whole-step models): a folder that lacks one is
 * refused at once, as Python's Module refuses it. What the session never reads (the inference
 * model; the folder's checkpoint where another state is given) may be left out.
 * @param {CreateOptions} options
 * @returns {Promise<{manifest: Manifest, where: string, sources: Models & {checkpoint: Source | CheckpointState}, present: Source[]}>} */
async function locate(options) {
  if (options.artifacts !== undefined) {
    const folder = options.artifacts;
    const manifestSource = resolveBeside(folder, MANIFEST);
    const manifest = await readManifest(manifestSource, String(manifestSource));
    /** @param {string} file */
    const at = (file) => resolveBeside(folder, file);
    /** @type {Models & {checkpoint: Source | CheckpointState}} */
    const sources = { checkpoint: options.checkpointState ?? at(manifest.checkpoint.file) };
    for (const key of modelKeys(manifest)) sources[key] = at(manifest.models[key].file);
    const later = modelKeys(manifest).filter((key) => READ_LATER.includes(key)).map((key) => at(manifest.models[key].file));
    return { manifest, where: String(folder), sources, present: later };
  }
  for (const key of /** @type {const} */ (['checkpointState', 'trainModel', 'optimizerModel'])) {
    if (options[key] === undefined) throw new OndeviceError(`create(): give '${key}' (or 'artifacts', the folder that holds them)`);
  }
  let manifestSource = options.manifest;
  if (manifestSource === undefined) {
    if (typeof options.trainModel !== 'string' && !(options.trainModel instanceof URL)) {
      throw new OndeviceError("create(): give 'manifest' where trainModel is bytes (it says what each input is)");
    }
    const model = String(options.trainModel);
    manifestSource = resolveBeside(model.slice(0, model.lastIndexOf('/') + 1) || '.', MANIFEST);
  }
  const manifest =
    manifestSource && typeof manifestSource === 'object' && 'format' in manifestSource
      ? checkManifest(manifestSource)
      : await readManifest(/** @type {Source} */ (manifestSource), String(manifestSource));
  const later = [options.evalModel, options.trainStepModel, options.trainStepsModel].filter((source) => source !== undefined);
  return {
    manifest,
    where: String(options.trainModel),
    sources: {
      checkpoint: /** @type {Source | CheckpointState} */ (options.checkpointState),
      training: options.trainModel,
      optimizer: options.optimizerModel,
      eval: options.evalModel,
      train_step: options.trainStepModel,
      train_steps: options.trainStepsModel,
    },
    present: /** @type {Source[]} */ (later),
  };
}

/** @param {Manifest} manifest */
function modelKeys(manifest) {
  return /** @type {ModelKey[]} */ (Object.keys(manifest.models));
}

/** The bytes of model ``key``, checked against the manifest's sha256 where ``verify``.
 * @param {Manifest} manifest
 * @param {ModelKey} key
 * @param {Source} source
 * @param {boolean} verify */
async function modelBytes(manifest, key, source, verify) {
  const entry = manifest.models[key];
  const bytes = await readBytes(source);
  if (verify) await checkHash(bytes, entry.sha256, name(source, entry.file));
  return bytes;
}

/** The checkpoint: read, each tensor checked against its CRC-32 (a damaged one is named), then
 * the file against the manifest's sha256 where ``verify`` (what the CRCs cannot see).
 * @param {Source | CheckpointState} source
 * @param {Manifest} manifest
 * @param {boolean} verify */
async function checkpointOf(source, manifest, verify) {
  if (source instanceof CheckpointState) return source;
  const where = name(source, manifest.checkpoint.file);
  const bytes = await readBytes(source);
  const state = CheckpointState.fromBytes(bytes, where);
  if (verify) await checkHash(bytes, manifest.checkpoint.sha256, where);
  return state;
}

/** Refuse a checkpoint that does not hold what the artifacts carry, naming the tensor.
 * @param {CheckpointState} state
 * @param {Manifest} manifest
 * @param {string} where */
function checkState(state, manifest, where) {
  for (const s of manifest.state) {
    const t = state.tensors.get(s.name);
    if (!t) throw new OndeviceError(`${where}: the checkpoint lacks tensor '${s.name}', which the artifacts carry`);
    if (t.dtype !== s.dtype || t.shape.length !== s.shape.length || t.shape.some((d, i) => d !== s.shape[i])) {
      throw new OndeviceError(`${where}: the checkpoint's tensor '${s.name}' is ${t.dtype} [${t.shape}], the artifacts carry ${s.dtype} [${s.shape}]`);
    }
  }
}

/** The execution providers to make the sessions with: the caller's, else the backend of the
 * namespace given. onnxruntime-node and onnxruntime-web may register with one
 * onnxruntime-common (both loaded through require() in one Node process), where the
 * highest-priority CPU backend, onnxruntime-node's, would take onnxruntime-web's sessions.
 * @param {OrtNamespace} ort
 * @param {SessionOptions} sessionOptions
 * @returns {string[]} */
function providersFor(ort, sessionOptions) {
  const given = sessionOptions.executionProviders;
  if (given?.length) return given.map((p) => (typeof p === 'string' ? p : p.name));
  if (typeof (/** @type {{listSupportedBackends?: unknown}} */ (ort).listSupportedBackends) === 'function') return ['cpu']; // onnxruntime-node
  if (ort.env?.versions?.web) return ['wasm']; // onnxruntime-web
  return [];
}

/** @param {Source} source @param {string} file */
function name(source, file) {
  return typeof source === 'string' || source instanceof URL ? String(source) : file;
}

/** @param {Uint8Array | ArrayBuffer} buffer */
function toFloat32(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  if (bytes.byteLength % 4) throw new OndeviceError(`loadParametersBuffer: ${bytes.byteLength} bytes is no whole number of float32 values`);
  return new Float32Array(bytes.slice().buffer);
}
