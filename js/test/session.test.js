// What a TrainingSession refuses, each with one error naming the file or the tensor: a
// changed or missing file, a damaged checkpoint, a newer manifest, batches of the wrong type or
// shape, a parameter buffer of the wrong size, steps out of order; the parameters as one buffer,
// trainable or all, frozen ones too. On onnxruntime-node, over artifacts Python wrote.
import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import * as ort from 'onnxruntime-node';
import { OndeviceError, TrainingSession } from '../src/index.js';
import { at, skip, values } from './fixtures.js';

/** @param {string} name */
function copy(name) {
  const target = mkdtempSync(join(tmpdir(), 'gf-art-'));
  for (const file of readdirSync(at(name))) copyFileSync(at(name, file), join(target, file));
  return target;
}

/** @param {number} [size] */
function batch(size = 4) {
  return {
    images: new ort.Tensor('uint8', new Uint8Array(size * 64).fill(3), [size, 8, 8]),
    labels: new ort.Tensor('int64', BigInt64Array.from({ length: size }, (_, i) => BigInt(i % 10)), [size]),
  };
}

test('a set trains, and its parameters go out and back as one buffer', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('digits') });
  const before = await session.getContiguousParameters();
  assert.equal(before.dims[0], session.getParametersSize());
  const { loss } = await session.runTrainStep(batch());
  assert.ok(Number.isFinite(loss.data[0]));
  await session.runOptimizerStep();
  assert.equal(session.checkpointState.step, 1);
  await session.loadParametersBuffer(new Uint8Array(before.data.buffer));
  assert.deepEqual([...(await session.getContiguousParameters()).data], [...before.data]);
  await session.release();
});

test('a file changed since the manifest was written is refused, naming it', { skip }, async () => {
  const folder = copy('digits');
  const model = join(folder, 'optimizer_model.onnx');
  const bytes = readFileSync(model);
  bytes[bytes.length - 1] ^= 1;
  writeFileSync(model, bytes);
  await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), /optimizer_model\.onnx: its sha256 is .+, the manifest's/);
});

test('a missing file and a newer manifest are refused', { skip }, async () => {
  await assert.rejects(TrainingSession.create({ ort, artifacts: join(tmpdir(), 'no-such-artifacts') }), /manifest\.json: no such file/);
  const folder = copy('digits');
  const document = JSON.parse(readFileSync(join(folder, 'manifest.json'), 'utf8'));
  writeFileSync(join(folder, 'manifest.json'), JSON.stringify({ ...document, version: 3 }));
  await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), /manifest version 3 is newer than this runtime reads \(2\)/);
});

test('runSteps trains k steps in one run, and refuses data that is not stacked, a bad k or rates, and pending accumulation', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('digits') });
  /** @param {number} k */
  const stacked = (k) => {
    const one = batch();
    return {
      images: new ort.Tensor('uint8', new Uint8Array(k * 4 * 64).fill(3), [k, 4, 8, 8]),
      labels: new ort.Tensor('int64', BigInt64Array.from({ length: k * 4 }, (_, i) => one.labels.data[i % 4]), [k, 4]),
    };
  };
  const { loss } = await session.runSteps(stacked(3), 3);
  assert.deepEqual(loss.dims, [3]);
  assert.equal(session.checkpointState.step, 3);
  await assert.rejects(session.runSteps(stacked(3), 2), /input 'images' has 3 steps stacked on its leading dim .*not stacked/);
  await assert.rejects(session.runSteps(batch(), 4), /input 'images' has 3 dims \[4,8,8\], the train_steps model takes 4/);
  await assert.rejects(session.runSteps(stacked(2), 0), /k must be a whole number ≥ 1, got 0/);
  await assert.rejects(session.runSteps(stacked(2), 2, { learningRates: [0.1] }), /learningRates takes the 2 steps' rates/);
  await session.runTrainStep(batch());
  await assert.rejects(session.runSteps(stacked(2), 2), /accumulation across runs/);
  await session.release();
});

test('batches of the wrong type, rank or size are refused, naming the input', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('digits') });
  const good = batch();
  const cases = [
    [{ ...good, labels: new ort.Tensor('int32', new Int32Array(4), [4]) }, /input 'labels' is int32, the training model takes int64/],
    [{ ...good, images: new ort.Tensor('uint8', new Uint8Array(4 * 63), [4, 9, 7]) }, /input 'images' has dim 1 = 9, the training model takes 8/],
    [{ ...good, images: new ort.Tensor('uint8', new Uint8Array(4 * 64), [4, 64]) }, /input 'images' has 2 dims \[4,64\], the training model takes 3/],
    [{ ...good, labels: new ort.Tensor('int64', new BigInt64Array(3), [3]) }, /input 'labels' has batch = 3, another input 4: they must agree/],
    [{ images: good.images }, /the training model needs input 'labels'/],
    [{ ...good, extra: good.labels }, /the training model has no input 'extra'; it takes: images, labels/],
    [{ ...good, images: new Uint8Array(256) }, /input 'images' must be an onnxruntime Tensor/],
  ];
  for (const [feeds, message] of cases) await assert.rejects(session.runTrainStep(feeds), message);
  assert.equal(session.checkpointState.microBatch, 0); // nothing ran
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(12)), /the trainable parameters hold 4810 float32 values \(19240 bytes\), the buffer 3 \(12 bytes\)/);
  await session.runTrainStep(good);
  await assert.rejects(session.runStep(good), /runStep\(\) is a whole step: runOptimizerStep\(\) for the gradients/);
  await session.release();
});

test('artifacts that do not accumulate take one train step per update', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('plain') });
  await assert.rejects(session.runOptimizerStep(), /no gradients yet \(runTrainStep first\)/);
  await session.runTrainStep(batch());
  await assert.rejects(session.runTrainStep(batch()), /these artifacts do not accumulate gradients/);
  await session.runOptimizerStep();
  await session.runTrainStep(batch());
  await session.release();
});

test('create() finds every model the manifest lists, those it reads at their first run too', { skip }, async () => {
  for (const file of ['eval_model.onnx', 'train_step.onnx']) {
    const folder = copy('digits');
    rmSync(join(folder, file));
    await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), (error) => {
      assert.ok(error instanceof OndeviceError);
      assert.equal(error.message, `${join(folder, file)}: no such file (the manifest lists it)`);
      return true;
    });
  }
});

test('what a session never reads may be left out: the inference model, the checkpoint where a state is given', { skip }, async () => {
  const folder = copy('digits');
  const state = (await TrainingSession.create({ ort, artifacts: folder })).checkpointState;
  rmSync(join(folder, 'inference.onnx'));
  rmSync(join(folder, 'checkpoint'));
  const session = await TrainingSession.create({ ort, artifacts: folder, checkpointState: state });
  await session.runTrainStep(batch());
  await session.runOptimizerStep();
  await session.release();
});

test('a released session refuses to run, and stays released', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('digits') });
  await session.runTrainStep(batch());
  await session.release();
  for (const run of [() => session.runTrainStep(batch()), () => session.runEvalStep(batch()), () => session.runOptimizerStep()]) {
    await assert.rejects(run(), /^OndeviceError: this TrainingSession was released: create another to train or evaluate$/);
  }
});

test('sessions made before a failing one are released', { skip }, async () => {
  /** @type {any[]} */
  const made = [];
  let calls = 0;
  const create = async (/** @type {Uint8Array} */ bytes, /** @type {object} */ options) => {
    if (++calls === 2) throw new Error('the optimizer model does not load');
    const session = await ort.InferenceSession.create(bytes, options);
    const release = session.release.bind(session);
    made.push({ released: false });
    const record = made[made.length - 1];
    session.release = async () => {
      record.released = true;
      return release();
    };
    return session;
  };
  await assert.rejects(TrainingSession.create({ ort: { ...ort, InferenceSession: { create } }, artifacts: at('digits') }), /the optimizer model does not load/);
  assert.deepEqual(made, [{ released: true }]);
});

test('a damaged checkpoint in a folder is refused naming the tensor; any other change by its sha256', { skip }, async () => {
  const folder = copy('digits');
  const path = join(folder, 'checkpoint');
  const bytes = readFileSync(path);
  const length = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + length).toString());
  const last = Object.keys(header).filter((n) => n !== '__metadata__').sort((a, b) => header[b].data_offsets[1] - header[a].data_offsets[1])[0];
  bytes[bytes.length - 1] ^= 1; // the last byte of the tensor stored last
  writeFileSync(path, bytes);
  await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), new RegExp(`checkpoint: tensor '${last.replace(/\./g, '\\.')}' is damaged: its bytes do not match the checksum`));
  bytes[bytes.length - 1] ^= 1;
  const stepped = Buffer.from(bytes.toString('latin1').replace('\\"step\\": 0', '\\"step\\": 7'), 'latin1'); // every tensor whole, another state
  assert.notDeepEqual(stepped, bytes);
  writeFileSync(path, stepped);
  await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), /checkpoint: its sha256 is .+, the manifest's/);
});

test('the files given one by one: runStep needs trainStepModel, runEvalStep evalModel', { skip }, async () => {
  const files = { ort, checkpointState: at('digits', 'checkpoint'), trainModel: at('digits', 'training_model.onnx'), optimizerModel: at('digits', 'optimizer_model.onnx') };
  const without = await TrainingSession.create(files);
  await assert.rejects(without.runStep(batch()), /^OndeviceError: no whole-step model: give trainStepModel \(train_step\.onnx\) to create\(\), or artifacts/);
  await assert.rejects(without.runEvalStep(batch()), /^OndeviceError: no eval model: give evalModel \(eval_model\.onnx\) to create\(\), or artifacts/);
  const given = await TrainingSession.create({ ...files, trainStepModel: at('digits', 'train_step.onnx'), evalModel: at('digits', 'eval_model.onnx') });
  const folder = await TrainingSession.create({ ort, artifacts: at('digits') });
  for (const session of [given, folder]) await session.runStep(batch());
  assert.deepEqual([...(await given.getContiguousParameters()).data], [...(await folder.getContiguousParameters()).data]);
  assert.deepEqual((await given.runEvalStep(batch())).loss.data, (await folder.runEvalStep(batch())).loss.data);
  await Promise.all([without, given, folder].map((session) => session.release()));
});

test('frozen parameters: out of the trainable buffer, untouched by a step, set with trainableOnly false', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('frozen') });
  const state = session.checkpointState;
  const parameters = session.manifest.state.filter((s) => s.role === 'parameter' || s.role === 'frozen');
  assert.deepEqual(parameters.filter((s) => s.role === 'frozen').map((s) => s.name), values.frozen);
  assert.equal(session.getParametersSize(), 10 * 64 + 10);
  assert.equal(session.getParametersSize(false), 64 * 64 + 64 + 10 * 64 + 10);
  const fc1 = state.tensor('fc1.weight').data.slice();
  const fc2 = state.tensor('fc2.weight').data.slice();
  for (let step = 0; step < 2; step++) {
    await session.runTrainStep(batch());
    await session.runOptimizerStep();
    session.lazyResetGrad();
  }
  assert.deepEqual(state.tensor('fc1.weight').data, fc1);
  assert.notDeepEqual(state.tensor('fc2.weight').data, fc2);
  await session.loadParametersBuffer(new Float32Array(session.getParametersSize()));
  assert.deepEqual(state.tensor('fc1.weight').data, fc1);
  // every parameter, in the manifest's order: fc1 zero, so each row's logits are fc2's bias
  const all = new Float32Array(session.getParametersSize(false));
  const bias = Float32Array.from({ length: 10 }, (_, k) => (k - 4) / 8);
  let offset = 0;
  for (const s of parameters) {
    if (s.name === 'fc2.bias') all.set(bias, offset);
    offset += s.shape.reduce((a, b) => a * b, 1);
  }
  await session.loadParametersBuffer(all, false);
  assert.deepEqual([...(await session.getContiguousParameters(false)).data], [...all]);
  const feeds = batch();
  const { loss, logits } = await session.runEvalStep(feeds);
  for (let row = 0; row < 4; row++) assert.deepEqual([...logits.data.slice(row * 10, row * 10 + 10)], [...bias]);
  const logSum = Math.log(bias.reduce((sum, b) => sum + Math.exp(b), 0));
  const expected = [...feeds.labels.data].reduce((sum, label) => sum + logSum - bias[Number(label)], 0) / 4;
  assert.ok(Math.abs(Number(loss.data[0]) - expected) < 1e-6, `${loss.data[0]} against ${expected}`);
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(12), false), /the parameters hold 4810 float32 values/);
  await session.release();
});

test('a session shows its API, not its workings', { skip }, async () => {
  const session = await TrainingSession.create({ ort, artifacts: at('digits') });
  const shown = /** @type {Record<string, unknown>} */ (/** @type {unknown} */ (session));
  for (const name of ['run', 'feedsFor', 'handed', 'reported', 'check', 'load', 'session', 'sessions', 'pending', 'parameters', 'ort', 'gradients']) {
    assert.equal(shown[name], undefined, name);
  }
  assert.throws(() => new /** @type {any} */ (TrainingSession)(), /make a TrainingSession with TrainingSession\.create/);
  await session.release();
});

test('create() says what it needs', async () => {
  await assert.rejects(TrainingSession.create({ artifacts: 'x' }), OndeviceError);
  await assert.rejects(TrainingSession.create({ ort, trainModel: 'a.onnx' }), /give 'checkpointState'/);
});
