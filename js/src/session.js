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
import { readBytes, resolveBeside } from './files.js';
import { checkHash, checkManifest, readManifest } from './manifest.js';

const MANIFEST = 'manifest.json';

export class TrainingSession {
  /**
   * Load a set of artifacts. ``options``: ``ort`` (the onnxruntime namespace), and either
   * ``artifacts`` (a folder path or URL holding manifest.json and the files it names) or
   * ``checkpointState``, ``trainModel``, ``optimizerModel`` (and ``evalModel``), each a path,
   * URL or bytes (the checkpoint may be a CheckpointState), with ``manifest`` where the models
   * are bytes (else the manifest.json beside ``trainModel``). ``verify`` (default true)
   * checks every file against the manifest's sha256. ``sessionOptions`` go to onnxruntime.
   */
  static async create(options, sessionOptions = {}) {
    const { ort } = options;
    if (!ort?.InferenceSession || !ort?.Tensor) throw new OndeviceError('create({ort, ...}): give the onnxruntime namespace (onnxruntime-node or onnxruntime-web)');
    const verify = options.verify ?? true;
    const { manifest, where, sources } = await locate(options);
    const load = async (key, source) => {
      const entry = manifest.models[key];
      const bytes = await readBytes(source);
      if (verify) await checkHash(bytes, entry.sha256, name(source, entry.file));
      return bytes;
    };
    let state = sources.checkpoint;
    if (!(state instanceof CheckpointState)) {
      const bytes = await readBytes(state);
      if (verify) await checkHash(bytes, manifest.checkpoint.sha256, name(state, manifest.checkpoint.file));
      state = CheckpointState.fromBytes(bytes, name(state, manifest.checkpoint.file));
    }
    const session = new TrainingSession(ort, manifest, state, sessionOptions, where);
    session.check();
    for (const key of ['training', 'optimizer']) session.sessions[key] = await ort.InferenceSession.create(await load(key, sources[key]), sessionOptions);
    session.pending = { eval: sources.eval, train_step: sources.train_step };
    session.load = load;
    return session;
  }

  constructor(ort, manifest, state, sessionOptions, where) {
    this.ort = ort;
    this.manifest = manifest;
    this.checkpointState = state;
    this.sessionOptions = sessionOptions;
    this.where = where;
    this.sessions = {};
    this.gradients = null; // what a training run handed over, where the artifacts do not accumulate
    if (state.learningRate === null || state.learningRate === undefined) state.learningRate = manifest.default_lr;
    const ports = (key, role) => (manifest.models[key]?.inputs ?? []).filter((p) => role.includes(p.role)).map((p) => p.name);
    this.trainingInputNames = ports('training', ['batch', 'labels']);
    this.evalInputNames = ports('eval', ['batch', 'labels']);
    this.trainingOutputNames = [manifest.loss, ...manifest.outputs];
    this.evalOutputNames = [manifest.loss, ...manifest.outputs];
    this.parameterNames = manifest.state.filter((s) => s.role === 'parameter').map((s) => s.name);
  }

  /** Refuse a checkpoint that does not hold what the artifacts carry, naming the tensor. */
  check() {
    for (const s of this.manifest.state) {
      const t = this.checkpointState.tensors.get(s.name);
      if (!t) throw new OndeviceError(`${this.where}: the checkpoint lacks tensor '${s.name}', which the artifacts carry`);
      if (t.dtype !== s.dtype || t.shape.length !== s.shape.length || t.shape.some((d, i) => d !== s.shape[i])) {
        throw new OndeviceError(`${this.where}: the checkpoint's tensor '${s.name}' is ${t.dtype} [${t.shape}], the artifacts carry ${s.dtype} [${s.shape}]`);
      }
    }
  }

  // ------------------------------------------------------------------ steps

  /** Forward and backward on ``feeds`` (input name -> ort.Tensor): the gradients accumulate
   * until lazyResetGrad(). Returns the loss and the other outputs, by name. */
  async runTrainStep(feeds) {
    if (!this.manifest.accumulates && this.gradients) {
      throw new OndeviceError('these artifacts do not accumulate gradients: runOptimizerStep() after each runTrainStep() (write them from a program compiled with accumulate=true to accumulate)');
    }
    const outputs = await this.run('training', feeds);
    const state = this.checkpointState;
    state.gradResetPending = false;
    state.microBatch += 1;
    if (!this.manifest.accumulates) this.gradients = this.handed('training', outputs);
    return this.reported('training', outputs);
  }

  /** The update with the accumulated gradients; counts the step. Returns its reports (grad_norm). */
  async runOptimizerStep() {
    if (!this.manifest.accumulates && !this.gradients) throw new OndeviceError('runOptimizerStep(): no gradients yet (runTrainStep first)');
    const outputs = await this.run('optimizer', {});
    const state = this.checkpointState;
    state.step += 1;
    state.microBatch = 0;
    this.gradients = null;
    return this.reported('optimizer', outputs);
  }

  /** The next runTrainStep overwrites the accumulated gradients instead of adding to them. */
  lazyResetGrad() {
    this.checkpointState.gradResetPending = true;
  }

  /** Forward and loss in eval mode (Dropout off, BatchNorm on its running statistics). */
  async runEvalStep(feeds) {
    return this.reported('eval', await this.run('eval', feeds));
  }

  /** One whole step in one run (train_step.onnx): forward, backward and update, where no
   * gradients wait from runTrainStep. The fast path when nothing accumulates. */
  async runStep(feeds) {
    if (!this.checkpointState.gradResetPending && this.manifest.accumulates) {
      throw new OndeviceError('runStep() is a whole step: runOptimizerStep() for the gradients runTrainStep() accumulated first, or lazyResetGrad()');
    }
    const outputs = await this.run('train_step', feeds);
    const state = this.checkpointState;
    state.step += 1;
    state.microBatch = 0;
    state.gradResetPending = true;
    return this.reported('train_step', outputs);
  }

  // ------------------------------------------------------------------ the rate, the parameters, the state

  setLearningRate(lr) {
    if (typeof lr !== 'number' || !Number.isFinite(lr) || lr < 0) throw new OndeviceError(`the learning rate must be a finite number ≥ 0, got ${lr}`);
    this.checkpointState.learningRate = lr;
  }

  getLearningRate() {
    return this.checkpointState.learningRate;
  }

  /** How many elements the (trainable) parameters hold together. */
  getParametersSize(trainableOnly = true) {
    return this.parameters(trainableOnly).reduce((n, name) => n + elementCount(this.checkpointState.tensor(name).shape), 0);
  }

  /** The parameters in one float32 tensor, in the manifest's order (what federated averaging sends). */
  async getContiguousParameters(trainableOnly = true) {
    const out = new Float32Array(this.getParametersSize(trainableOnly));
    let at = 0;
    for (const name of this.parameters(trainableOnly)) {
      const t = this.checkpointState.tensor(name);
      if (t.dtype !== 'float32') throw new OndeviceError(`parameter '${name}' is ${t.dtype}: the contiguous parameters are float32`);
      out.set(t.data, at);
      at += t.data.length;
    }
    return new this.ort.Tensor('float32', out, [out.length]);
  }

  /** Replace the parameters with ``buffer`` (the bytes of getContiguousParameters' data, or a Float32Array). */
  async loadParametersBuffer(buffer, trainableOnly = true) {
    const values = buffer instanceof Float32Array ? buffer : toFloat32(buffer);
    const size = this.getParametersSize(trainableOnly);
    if (values.length !== size) {
      throw new OndeviceError(`loadParametersBuffer: the parameters hold ${size} float32 values (${size * 4} bytes), the buffer ${values.length} (${values.length * 4} bytes)`);
    }
    let at = 0;
    for (const name of this.parameters(trainableOnly)) {
      const t = this.checkpointState.tensor(name);
      t.data = values.slice(at, at + t.data.length);
      at += t.data.length;
    }
  }

  parameters() {
    return this.parameterNames;
  }

  /** The state as checkpoint bytes (graphforge in Python loads them: CheckpointState.load). */
  checkpointBytes() {
    return this.checkpointState.toBytes();
  }

  /** Write the state to ``path`` at once (Node). */
  async saveCheckpoint(path) {
    return this.checkpointState.save(path);
  }

  async release() {
    for (const session of Object.values(this.sessions)) await session.release();
    this.sessions = {};
  }

  // ------------------------------------------------------------------ running one model

  async session(key) {
    if (!this.sessions[key]) {
      const source = this.pending[key];
      if (!source) throw new OndeviceError(`no ${key === 'eval' ? 'eval' : 'whole-step'} model: give ${key === 'eval' ? 'evalModel' : 'artifacts'} to create()`);
      this.sessions[key] = await this.ort.InferenceSession.create(await this.load(key, source), this.sessionOptions);
    }
    return this.sessions[key];
  }

  async run(key, feeds) {
    const entry = this.manifest.models[key];
    const inputs = this.feedsFor(key, entry, feeds);
    const session = await this.session(key);
    const outputs = await session.run(inputs);
    const state = this.checkpointState;
    for (const port of entry.outputs) {
      if (port.role === 'state') {
        const t = state.tensor(port.state);
        t.data = outputs[port.name].data;
      }
    }
    return outputs;
  }

  feedsFor(key, entry, feeds) {
    const ort = this.ort;
    const state = this.checkpointState;
    const inputs = {};
    const dims = {};
    for (const port of entry.inputs) {
      switch (port.role) {
        case 'batch':
        case 'labels':
          inputs[port.name] = checkedFeed(feeds, port, dims, key);
          break;
        case 'state': {
          const t = state.tensor(port.state);
          inputs[port.name] = new ort.Tensor(dtypeInfo(t.dtype).ort, t.data, t.shape);
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
          inputs[port.name] = this.gradients[port.name];
          break;
        default:
          throw new OndeviceError(`${this.where}: input '${port.name}' of the ${key} model has the role '${port.role}', which this runtime does not know`);
      }
    }
    const unknown = Object.keys(feeds).filter((n) => !entry.inputs.some((p) => p.name === n && (p.role === 'batch' || p.role === 'labels')));
    if (unknown.length) {
      const known = entry.inputs.filter((p) => p.role === 'batch' || p.role === 'labels').map((p) => p.name);
      throw new OndeviceError(`the ${key} model has no input '${unknown[0]}'; it takes: ${known.join(', ')}`);
    }
    return inputs;
  }

  handed(key, outputs) {
    const handed = {};
    for (const port of this.manifest.models[key].outputs) if (port.role === 'gradient') handed[port.name] = outputs[port.name];
    return handed;
  }

  reported(key, outputs) {
    const shown = {};
    for (const port of this.manifest.models[key].outputs) {
      if (port.role === 'loss' || port.role === 'output' || port.role === 'report') shown[port.name] = outputs[port.name];
    }
    return shown;
  }
}

/** A batch input of the feeds, checked against the manifest: present, of its dtype, of its
 * rank and fixed dims, and its symbolic dims the same wherever they are named. */
function checkedFeed(feeds, port, dims, key) {
  const value = feeds[port.name];
  if (value === undefined) throw new OndeviceError(`the ${key} model needs input '${port.name}' (${port.dtype} [${port.shape}])`);
  if (!value || typeof value.type !== 'string' || !Array.isArray(value.dims)) {
    throw new OndeviceError(`input '${port.name}' must be an onnxruntime Tensor (new ort.Tensor(type, data, dims))`);
  }
  if (dtypeOfOrt(value.type) !== port.dtype) {
    throw new OndeviceError(`input '${port.name}' is ${value.type}, the ${key} model takes ${port.dtype}`);
  }
  if (port.shape) {
    if (value.dims.length !== port.shape.length) {
      throw new OndeviceError(`input '${port.name}' has ${value.dims.length} dims [${value.dims}], the ${key} model takes ${port.shape.length} [${port.shape}]`);
    }
    port.shape.forEach((want, i) => {
      const got = value.dims[i];
      if (typeof want === 'number' && got !== want) {
        throw new OndeviceError(`input '${port.name}' has dim ${i} = ${got}, the ${key} model takes ${want} ([${port.shape}])`);
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

/** Where each file of the artifacts comes from, and the manifest. */
async function locate(options) {
  if (options.artifacts !== undefined) {
    const folder = options.artifacts;
    const manifestSource = resolveBeside(folder, MANIFEST);
    const manifest = await readManifest(manifestSource, String(manifestSource));
    const at = (file) => resolveBeside(folder, file);
    const sources = { checkpoint: options.checkpointState ?? at(manifest.checkpoint.file) };
    for (const key of Object.keys(manifest.models)) sources[key] = at(manifest.models[key].file);
    return { manifest, where: String(folder), sources };
  }
  for (const key of ['checkpointState', 'trainModel', 'optimizerModel']) {
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
    manifestSource && typeof manifestSource === 'object' && manifestSource.format
      ? checkManifest(manifestSource)
      : await readManifest(manifestSource, String(manifestSource));
  return {
    manifest,
    where: String(options.trainModel),
    sources: {
      checkpoint: options.checkpointState,
      training: options.trainModel,
      optimizer: options.optimizerModel,
      eval: options.evalModel,
      train_step: options.trainStepModel,
    },
  };
}

function name(source, file) {
  return typeof source === 'string' || source instanceof URL ? String(source) : file;
}

function toFloat32(buffer) {
  const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
  if (bytes.byteLength % 4) throw new OndeviceError(`loadParametersBuffer: ${bytes.byteLength} bytes is no whole number of float32 values`);
  return new Float32Array(bytes.slice().buffer);
}
