// One side of benchmarks/steps_bench.py in this Node process: graphforge's JavaScript runtime
// training an artifact folder, one step a run (runStep, k = 1) or k steps a run (runSteps).
// One argument, the job's JSON: {artifacts, batches: {file, steps: [[{name, dtype, shape, offset, bytes}]]},
// backend: "node" | "web", threads, k, warmupSeconds, blockSeconds, blocks}. It prints one JSON
// line: the blocks' milliseconds a step and the first losses.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { TrainingSession } from '../../js/src/index.js';

const job = JSON.parse(process.argv[2]);
const runtime = createRequire(new URL('../../js/package.json', import.meta.url));
const ort = runtime(job.backend === 'web' ? 'onnxruntime-web' : 'onnxruntime-node');
if (job.backend === 'web') ort.env.wasm.numThreads = job.threads;
const options = job.backend === 'web' ? {} : { intraOpNumThreads: job.threads, interOpNumThreads: 1 };
const session = await TrainingSession.create({ ort, artifacts: job.artifacts }, options);

const bytes = readFileSync(job.batches.file);
const arrays = { float32: Float32Array, int64: BigInt64Array, uint8: Uint8Array };
const batches = job.batches.steps.map((step) =>
  Object.fromEntries(step.map((t) => [t.name, { type: t.dtype, dims: t.shape, data: new arrays[t.dtype](bytes.buffer.slice(bytes.byteOffset + t.offset, bytes.byteOffset + t.offset + t.bytes)) }])),
);
const k = job.k;
/** The feeds of run ``r``: one batch, or k stacked on a new leading dim (made before timing). */
function feedsOf(r) {
  const parts = Array.from({ length: k }, (_, i) => batches[(r * k + i) % batches.length]);
  const feeds = {};
  for (const [name, t] of Object.entries(parts[0])) {
    if (k === 1) {
      feeds[name] = new ort.Tensor(t.type, t.data, t.dims);
      continue;
    }
    const data = new t.data.constructor(t.data.length * k);
    parts.forEach((part, i) => data.set(part[name].data, i * t.data.length));
    feeds[name] = new ort.Tensor(t.type, data, [k, ...t.dims]);
  }
  return feeds;
}
const prepared = Array.from({ length: Math.max(1, Math.ceil(batches.length / k)) }, (_, r) => feedsOf(r));
const loss = session.manifest.loss;
let run = 0;
/** One run, its losses awaited (a loop that logs them). */
async function once() {
  const feeds = prepared[run++ % prepared.length];
  const out = k === 1 ? await session.runStep(feeds) : await session.runSteps(feeds, k);
  return Array.from(out[loss].data, Number);
}

const losses = [];
let last = 0;
const begun = performance.now();
while (run < 3 || performance.now() - begun < job.warmupSeconds * 1000) {
  const started = performance.now();
  losses.push(...(await once()));
  last = performance.now() - started;
}
const count = Math.max(1, Math.round((job.blockSeconds * 1000) / Math.max(last, 1e-3)));
const blocks = [];
for (let b = 0; b < job.blocks; b++) {
  const started = performance.now();
  for (let i = 0; i < count; i++) await once();
  blocks.push((performance.now() - started) / (count * k));
}
console.log(JSON.stringify({ blocks, losses: losses.slice(0, 5) }));
await session.release();
