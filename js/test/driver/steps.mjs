// Train an artifact folder for the Python tests (tests/ondevice/test_js_runtime.py), which
// hold what it computes against graphforge in Python. One argument: a JSON job
//   {backend: "node" | "web", artifacts, batches: {file, tensors: [{name, dtype, shape, offset, bytes}] per step},
//    steps, accumulate, schedule, resume, save, eval, threads, gradientsOnly}
// It prints one JSON line: the loss of each step (mean over its micro-batches), the eval
// loss, and the session's step and learning rate; ``save`` is where it writes its checkpoint.
import { readFileSync } from 'node:fs';
import { CheckpointState, TrainingSession, makeSchedule } from '../../src/index.js';

const job = JSON.parse(process.argv[2]);
const ort = job.backend === 'web' ? await import('onnxruntime-web') : await import('onnxruntime-node');
if (job.backend === 'web') ort.env.wasm.numThreads = job.threads ?? 1;
const options = job.backend === 'web' ? { executionProviders: ['wasm'] } : { intraOpNumThreads: job.threads ?? 1 };

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

const checkpointState = job.resume ? await CheckpointState.load(job.resume) : undefined;
const session = await TrainingSession.create({ ort, artifacts: job.artifacts, ...(checkpointState ? { checkpointState } : {}) }, options);
const schedule = job.schedule ? makeSchedule(job.schedule.kind, session, { ...job.schedule.options, lastStep: session.checkpointState.step }) : null;
const losses = [];
const learningRates = [];
let next = 0;
const started = performance.now();
if (job.gradientsOnly) await session.runTrainStep(batch(next++)); // the accumulators then hold one batch's gradients
for (let step = 0; step < job.steps; step++) {
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
let evalLoss = null;
if (job.eval !== undefined && job.eval !== null) evalLoss = Number((await session.runEvalStep(batch(job.eval)))[session.manifest.loss].data[0]);
if (schedule) session.checkpointState.scheduler = schedule.stateDict();
if (job.save) await session.saveCheckpoint(job.save);
console.log(JSON.stringify({ losses, learningRates, evalLoss, step: session.checkpointState.step, lr: session.getLearningRate(), seconds }));
await session.release();
