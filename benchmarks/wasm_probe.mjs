// Run a model once on onnxruntime-node or onnxruntime-web's wasm backend and write every output
// (float32 ones as raw bytes), for benchmarks/wasm_kernels.py.
//   node benchmarks/wasm_probe.mjs JOB.json   (JOB: {backend, model, feeds: {name: {dtype, shape, file}}, out})
import { readFileSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';

const job = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const require = createRequire(new URL('../js/package.json', import.meta.url));
const ort = job.backend === 'web' ? await import(require.resolve('onnxruntime-web')) : require('onnxruntime-node');
if (job.backend === 'web') ort.env.wasm.numThreads = 1;
const arrays = { float32: Float32Array, int64: BigInt64Array, uint8: Uint8Array, bool: Uint8Array };
const feeds = {};
for (const [name, { dtype, shape, file }] of Object.entries(job.feeds)) {
  const bytes = readFileSync(file);
  const data = new arrays[dtype](bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
  feeds[name] = new ort.Tensor(dtype, data, shape);
}
const session = await ort.InferenceSession.create(readFileSync(job.model), job.backend === 'web' ? { executionProviders: ['wasm'] } : {});
const outputs = await session.run(feeds);
const index = {};
let blob = [];
let offset = 0;
for (const [name, tensor] of Object.entries(outputs)) {
  if (tensor.type !== 'float32') continue;
  const bytes = new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength);
  index[name] = { offset, shape: tensor.dims };
  blob.push(bytes);
  offset += bytes.byteLength;
}
writeFileSync(`${job.out}.bin`, Buffer.concat(blob));
writeFileSync(`${job.out}.json`, JSON.stringify(index));
