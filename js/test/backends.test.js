// onnxruntime-node and onnxruntime-web in one Node process. Loaded through require(), both
// register their backends with one onnxruntime-common, whose highest-priority CPU backend is
// onnxruntime-node's: a session onnxruntime-web's namespace makes without naming a provider
// runs there. A TrainingSession runs on the backend of the namespace it was given, and says so.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { test } from 'node:test';
import { TrainingSession } from '../src/index.js';
import { at, skip } from './fixtures.js';

const require = createRequire(import.meta.url);
const node = require('onnxruntime-node');
const web = require('onnxruntime-web');
const webImported = await import('onnxruntime-web'); // its ES module build: an onnxruntime-common of its own
for (const ort of [web, webImported]) ort.env.wasm.numThreads = 1;

/** @param {any} ort */
function batch(ort) {
  return {
    images: new ort.Tensor('uint8', new Uint8Array(4 * 64).fill(3), [4, 8, 8]),
    labels: new ort.Tensor('int64', BigInt64Array.from([1n, 2n, 3n, 4n]), [4]),
  };
}

/** ``ort`` with an InferenceSession.create that keeps what it made.
 * @param {any} ort */
function recording(ort) {
  /** @type {any[]} */
  const made = [];
  const create = async (/** @type {Uint8Array} */ bytes, /** @type {object} */ options) => {
    const session = await ort.InferenceSession.create(bytes, options);
    made.push(session);
    return session;
  };
  return { made, ort: { ...ort, InferenceSession: { create } } };
}

test('each namespace runs on its own backend, in one process that loads both', { skip }, async () => {
  assert.equal(web.InferenceSession, node.InferenceSession, 'the premise: one onnxruntime-common under require()');
  const bytes = readFileSync(at('digits', 'eval_model.onnx'));
  /** @param {any} ort @param {object} [options] */
  const handler = async (ort, options) => (/** @type {any} */ (await ort.InferenceSession.create(bytes, options))).handler.constructor;
  const native = await handler(node);
  assert.equal(await handler(web), native, 'the premise: onnxruntime-web without a provider runs natively');
  const cases = [
    { name: 'onnxruntime-node', ort: node, providers: ['cpu'], handler: native },
    { name: 'onnxruntime-web', ort: web, providers: ['wasm'], handler: await handler(web, { executionProviders: ['wasm'] }) },
    { name: 'onnxruntime-web, imported', ort: webImported, providers: ['wasm'], handler: await handler(webImported, { executionProviders: ['wasm'] }) },
  ];
  for (const { name, ort, providers, handler: expected } of cases) {
    const { made, ort: recorded } = recording(ort);
    const session = await TrainingSession.create({ ort: recorded, artifacts: at('digits') });
    assert.deepEqual(session.executionProviders, providers, name);
    await session.runTrainStep(batch(ort));
    await session.runOptimizerStep();
    await session.runEvalStep(batch(ort));
    assert.equal(made.length, 3, name); // training, optimizer, eval
    for (const made_ of made) assert.equal(made_.handler.constructor, expected, name);
    if (ort !== node) assert.notEqual(expected, native, name);
    await session.release();
  }
  /** @type {any[]} */
  const asked = [];
  const asking = { ...web, InferenceSession: { create: (/** @type {Uint8Array} */ b, /** @type {any} */ o) => (asked.push(o), web.InferenceSession.create(b, o)) } };
  const provider = { name: 'cpu', useArena: false };
  const chosen = await TrainingSession.create({ ort: asking, artifacts: at('digits') }, { executionProviders: [provider], graphOptimizationLevel: 'all' });
  assert.deepEqual(chosen.executionProviders, ['cpu']); // the caller's choice stands
  for (const options of asked) assert.deepEqual(options, { executionProviders: [provider], graphOptimizationLevel: 'all' }); // as given, options and all
  assert.equal(asked.length, 2);
  await chosen.release();
});
