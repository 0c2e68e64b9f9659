// One side of benchmarks/ondevice_bench.py in this Node process. One argument, the job's JSON
// (see sides.mjs); it prints one JSON line: the blocks' milliseconds a step, the first losses,
// and the process's peak resident memory.
import { readFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { PerformanceObserver } from 'node:perf_hooks';
import { measure } from './sides.mjs';

const job = JSON.parse(process.argv[2]);
// the runtime's own packages (js/package.json) and TensorFlow.js (this folder's package.json)
const runtime = createRequire(new URL('../../js/package.json', import.meta.url));
const load = async (file) => {
  const bytes = await readFile(file);
  return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
};
let collecting = 0;
new PerformanceObserver((list) => {
  for (const entry of list.getEntries()) collecting += entry.duration;
}).observe({ entryTypes: ['gc'] });
const libraries = { load, gcClock: () => collecting };
if (job.side === 'tfjs') {
  libraries.tf = await import('@tensorflow/tfjs');
  if (job.backend === 'wasm') libraries.tfWasm = await import('@tensorflow/tfjs-backend-wasm');
} else {
  libraries.ort = runtime(job.backend === 'web' ? 'onnxruntime-web' : 'onnxruntime-node');
}
const result = await measure(job, libraries);
result.peakMiB = process.resourceUsage().maxRSS / 1024;
console.log(JSON.stringify(result));
