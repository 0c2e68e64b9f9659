import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { CheckpointState, OndeviceError, crc32 } from '../src/index.js';
import { at, skip } from './fixtures.js';

function sample() {
  return new CheckpointState({
    tensors: new Map([
      ['w', { dtype: 'float32', shape: [2, 3], data: Float32Array.from([1, 2, 3, 4, 5, 6]) }],
      ['count', { dtype: 'int64', shape: [], data: BigInt64Array.from([7n]) }],
      ['flag', { dtype: 'bool', shape: [2], data: Uint8Array.from([1, 0]) }],
      ['b', { dtype: 'float64', shape: [1], data: Float64Array.from([0.25]) }],
    ]),
    roles: { w: 'parameter', count: 'buffer', flag: 'buffer', b: 'optimizer' },
    step: 12,
    learningRate: 0.01,
    properties: { note: 'kept' },
  });
}

test('crc32 is zlib\'s', () => {
  assert.equal(crc32(new TextEncoder().encode('The quick brown fox jumps over the lazy dog')), 0x414fa339);
});

test('a checkpoint round-trips through its bytes', () => {
  const again = CheckpointState.fromBytes(sample().toBytes());
  assert.equal(again.step, 12);
  assert.equal(again.learningRate, 0.01);
  assert.deepEqual(again.properties, { note: 'kept' });
  assert.deepEqual([...again.tensor('w').data], [1, 2, 3, 4, 5, 6]);
  assert.deepEqual(again.tensor('w').shape, [2, 3]);
  assert.equal(again.tensor('count').data[0], 7n);
  assert.deepEqual([...again.tensor('flag').data], [1, 0]);
  assert.equal(again.roles.w, 'parameter');
});

test('a damaged byte is refused, naming the tensor', () => {
  const bytes = sample().toBytes();
  bytes[bytes.length - 1] ^= 1; // the last tensor's last byte
  assert.throws(() => CheckpointState.fromBytes(bytes, 'damaged.ckpt'), (error) => {
    assert.ok(error instanceof OndeviceError);
    assert.match(error.message, /^damaged\.ckpt: tensor '.+' is damaged: its bytes do not match the checksum/);
    return true;
  });
});

test('a truncated file is refused, naming the first tensor cut', () => {
  const bytes = sample().toBytes();
  assert.throws(() => CheckpointState.fromBytes(bytes.subarray(0, bytes.length - 3), 'cut.ckpt'), /^OndeviceError: cut\.ckpt: truncated: tensor '.+' needs data bytes/);
  assert.throws(() => CheckpointState.fromBytes(bytes.subarray(0, 5), 'cut.ckpt'), /cut short before its header/);
});

test('what is not a checkpoint is refused', () => {
  assert.throws(() => CheckpointState.fromBytes(new Uint8Array(64).fill(7), 'noise'), /noise: not a checkpoint/);
});

test('a save is atomic and loads back', async () => {
  const path = join(mkdtempSync(join(tmpdir(), 'gf-ckpt-')), 'state.ckpt');
  await sample().save(path);
  const again = await CheckpointState.load(path);
  assert.equal(again.step, 12);
  await assert.rejects(CheckpointState.load(join(path, 'nope')), /no such file|ENOTDIR|not a directory/);
});

test('a checkpoint graphforge wrote in Python loads, its checksums checked', { skip }, () => {
  const state = CheckpointState.fromBytes(readFileSync(at('digits', 'checkpoint')), 'checkpoint');
  assert.equal(state.tensor('fc1.weight').dtype, 'float32');
  assert.deepEqual(state.tensor('fc1.weight').shape, [64, 64]);
  assert.equal(state.roles['fc1.weight'], 'parameter');
});
