// Train an artifact folder for the Python tests (tests/ondevice/test_js_runtime.py), which
// hold what it computes against graphforge in Python. One argument: a JSON job
//   {backend: "node" | "web", artifacts, batches: {file, tensors: [{name, dtype, shape, offset, bytes}] per step},
//    steps, accumulate, schedule, resume, save, eval, threads, gradientsOnly, parameters,
//    load: {file, trainableOnly}, stepsPerRun}
// It prints one JSON line: the loss of each step (mean over its micro-batches), the eval
// loss, the session's step and learning rate, its execution providers, and with ``parameters``
// the contiguous parameters after the steps (trainable, and all); ``load`` replaces the
// parameters with a float32 file's before the eval; ``save`` is where it writes its checkpoint.
import { readFileSync } from 'node:fs';
import { CheckpointState, TrainingSession, makeSchedule } from '../../src/index.js';

const job = JSON.parse(process.argv[2]);
const backend = job.backend === 'web' ? 'onnxruntime-web' : 'onnxruntime-node';
const ort = await import(backend).catch(() => {
  console.error(`${backend} is missing: run make install first (it runs npm ci in js/)`);
  process.exit(2);
});
if (job.backend === 'web') ort.env.wasm.numThreads = job.threads ?? 1;
// onnxruntime-web's sessions run on its wasm backend unless told otherwise (TrainingSession.create)
const options = job.backend === 'web' ? {} : { intraOpNumThreads: job.threads ?? 1 };

const bytes = readFileSync(job.batches.file);
const arrays = { float32: Float32Array, int64: BigInt64Array, uint8: Uint8Array, int32: Int32Array };
function batch(i) {
  const feeds = {};
  for (const t of job.batches.steps[i]) {
    const slice = bytes.buffer.slice(bytes.byteOffset + t.offset, bytes.byteOffset + t.offset + t.bytes);
    feeds[t.name] = new ort.Tensor(t.dtype, new arrays[t.dtype](slice), t.shape);
  }
  return feeds;
}

/** Batches first … first + k - 1 stacked on a new leading dim: what runSteps takes. */
function stacked(first, k) {
  const parts = Array.from({ length: k }, (_, i) => batch(first + i));
  const feeds = {};
  for (const [name, t] of Object.entries(parts[0])) {
    const data = new t.data.constructor(t.data.length * k);
    parts.forEach((part, i) => data.set(part[name].data, i * t.data.length));
    feeds[name] = new ort.Tensor(t.type, data, [k, ...t.dims]);
  }
  return feeds;
}

const checkpointState = job.resume ? await CheckpointState.load(job.resume) : undefined;
const session = await TrainingSession.create({ ort, artifacts: job.artifacts, ...(checkpointState ? { checkpointState } : {}) }, options);
const schedule = job.schedule ? makeSchedule(job.schedule.kind, session, { ...job.schedule.options, lastStep: session.checkpointState.step }) : null;
const losses = [];
const learningRates = [];
let next = 0;
const started = performance.now();
if (job.gradientsOnly) await session.runTrainStep(batch(next++)); // the accumulators then hold one batch's gradients
for (let step = 0; job.stepsPerRun && step < job.steps; step += job.stepsPerRun) {
  const k = Math.min(job.stepsPerRun, job.steps - step);
  const rates = schedule ? schedule.nextRates(k) : Array.from({ length: k }, () => session.getLearningRate());
  learningRates.push(...rates);
  const out = await session.runSteps(stacked(next, k), k, { learningRates: rates });
  next += k;
  losses.push(...Array.from(out[session.manifest.loss].data, Number));
  if (schedule) for (let i = 0; i < k; i++) schedule.step();
}
for (let step = 0; !job.stepsPerRun && step < job.steps; step++) {
  learningRates.push(session.getLearningRate());
  if (job.fused) {
    const out = await session.runStep(batch(next++));
    losses.push(Number(out[session.manifest.loss].data[0]));
  } else {
    let sum = 0;
    for (let micro = 0; micro < (job.accumulate ?? 1); micro++) {
      const out = await session.runTrainStep(batch(next++));
      sum += Number(out[session.manifest.loss].data[0]);
    }
    await session.runOptimizerStep();
    session.lazyResetGrad();
    losses.push(sum / (job.accumulate ?? 1));
  }
  if (schedule) schedule.step();
}
const seconds = (performance.now() - started) / 1000;
const parameters = job.parameters
  ? { trainable: [...(await session.getContiguousParameters(true)).data], all: [...(await session.getContiguousParameters(false)).data] }
  : {};
if (job.load) await session.loadParametersBuffer(new Uint8Array(readFileSync(job.load.file)), job.load.trainableOnly);
let evalLoss = null;
if (job.eval !== undefined && job.eval !== null) evalLoss = Number((await session.runEvalStep(batch(job.eval)))[session.manifest.loss].data[0]);
if (schedule) session.checkpointState.scheduler = schedule.stateDict();
if (job.save) await session.saveCheckpoint(job.save);
const { step } = session.checkpointState;
console.log(JSON.stringify({ losses, learningRates, evalLoss, step, lr: session.getLearningRate(), seconds, executionProviders: session.executionProviders, ...parameters }));
await session.release();
