// What a TrainingSession refuses, each with one error naming the file or the tensor: a
// changed file, a newer manifest, batches of the wrong type or shape, a parameter buffer of
// the wrong size, steps out of order. On onnxruntime-node, over artifacts Python wrote.
import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import * as ort from 'onnxruntime-node';
import { OndeviceError, TrainingSession } from '../src/index.js';
import { at, skip } from './fixtures.js';

function copy(name) {
  const target = mkdtempSync(join(tmpdir(), 'gf-art-'));
  for (const file of readdirSync(at(name))) copyFileSync(at(name, file), join(target, file));
  return target;
}

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
  writeFileSync(join(folder, 'manifest.json'), JSON.stringify({ ...document, version: 2 }));
  await assert.rejects(TrainingSession.create({ ort, artifacts: folder }), /manifest version 2 is newer than this runtime reads \(1\)/);
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
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(12)), /the parameters hold 4810 float32 values \(19240 bytes\), the buffer 3 \(12 bytes\)/);
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

test('create() says what it needs', async () => {
  await assert.rejects(TrainingSession.create({ artifacts: 'x' }), OndeviceError);
  await assert.rejects(TrainingSession.create({ ort, trainModel: 'a.onnx' }), /give 'checkpointState'/);
});
