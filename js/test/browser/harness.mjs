// The browser's side of js/test/driver/steps.mjs: the same job (artifacts, batches, steps,
// eval), run on onnxruntime-web's wasm backend, its result in window.result.
import * as ort from '/js/node_modules/onnxruntime-web/dist/ort.all.bundle.min.mjs';
import { TrainingSession } from '/js/src/index.js';

window.result = null;
try {
  const job = await (await fetch(new URLSearchParams(location.search).get('job'))).json();
  ort.env.wasm.wasmPaths = '/js/node_modules/onnxruntime-web/dist/';
  ort.env.wasm.numThreads = 1;
  const bytes = await (await fetch(job.batches.url)).arrayBuffer();
  const arrays = { float32: Float32Array, int64: BigInt64Array, uint8: Uint8Array };
  const batch = (i) =>
    Object.fromEntries(job.batches.steps[i].map((t) => [t.name, new ort.Tensor(t.dtype, new arrays[t.dtype](bytes.slice(t.offset, t.offset + t.bytes)), t.shape)]));
  const session = await TrainingSession.create({ ort, artifacts: job.artifacts }, { executionProviders: ['wasm'] });
  const losses = [];
  for (let step = 0; step < job.steps; step++) {
    const out = await session.runTrainStep(batch(step));
    await session.runOptimizerStep();
    session.lazyResetGrad();
    losses.push(Number(out[session.manifest.loss].data[0]));
  }
  const evalLoss = job.eval === undefined ? null : Number((await session.runEvalStep(batch(job.eval)))[session.manifest.loss].data[0]);
  window.result = { done: true, losses, evalLoss, step: session.checkpointState.step };
} catch (error) {
  window.result = { done: false, error: String(error?.message ?? error) };
}
