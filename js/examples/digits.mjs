// The shipped 8×8 digits (data/digits/{train,test}.npz) as onnxruntime tensors, for the
// examples: numpy.savez's files (a zip of .npy arrays) read without a library, node:zlib
// inflating them.
import { readFileSync } from 'node:fs';
import { inflateRawSync } from 'node:zlib';

const DATA = new URL('../../data/digits/', import.meta.url);

/** @typedef {{dtype: 'uint8' | 'int64', shape: number[], data: Uint8Array | BigInt64Array}} Array_ */

/** Stop with one line naming what is missing and how to get it.
 * @param {string} what
 * @returns {never} */
export function missing(what) {
  console.error(`${what} is missing: run make install first (it runs npm ci in js/)`);
  process.exit(2);
}

/** The arrays of a .npz file, by name (the zip's local headers, zip64 sizes where numpy writes them).
 * @param {URL} path
 * @returns {Record<string, Array_>} */
export function readNpz(path) {
  const zip = readFileSync(path);
  /** @type {Record<string, Array_>} */
  const arrays = {};
  for (let at = 0; zip.readUInt32LE(at) === 0x04034b50; ) {
    const method = zip.readUInt16LE(at + 8);
    const names = zip.readUInt16LE(at + 26);
    const extras = zip.readUInt16LE(at + 28);
    let size = zip.readUInt32LE(at + 18);
    const extra = at + 30 + names;
    if (size === 0xffffffff) size = Number(zip.readBigUInt64LE(extra + 4 + 8)); // zip64: the sizes, uncompressed first
    const start = extra + extras;
    const stored = zip.subarray(start, start + size);
    arrays[zip.toString('utf8', at + 30, extra).replace(/\.npy$/, '')] = readNpy(method === 8 ? inflateRawSync(stored) : stored);
    at = start + size;
  }
  return arrays;
}

/** One .npy array: its header (dtype, shape), then its C-ordered data.
 * @param {Buffer} npy
 * @returns {Array_} */
function readNpy(npy) {
  const long = npy[6] >= 2;
  const length = long ? npy.readUInt32LE(8) : npy.readUInt16LE(8);
  const start = (long ? 12 : 10) + length;
  const header = npy.toString('latin1', long ? 12 : 10, start);
  const descr = /'descr': '([^']+)'/.exec(header)?.[1];
  const shape = (/'shape': \(([^)]*)\)/.exec(header)?.[1] ?? '').split(',').filter((d) => d.trim()).map(Number);
  const bytes = new Uint8Array(npy.subarray(start)); // a copy, aligned for any element size
  if (descr === '|u1') return { dtype: 'uint8', shape, data: bytes };
  if (descr === '<i8') return { dtype: 'int64', shape, data: new BigInt64Array(bytes.buffer) };
  throw new Error(`an .npy array of ${descr}: the digits are uint8 images and int64 labels`);
}

/** The training split in batches of ``batch``, ``epochs`` times in order, and the test split
 * whole, each {images: uint8 [n, 8, 8], labels: int64 [n]}.
 * @param {typeof import('onnxruntime-common')} ort
 * @param {{batch?: number, epochs?: number}} [options] */
export function digits(ort, { batch = 32, epochs = 1 } = {}) {
  /** @param {Record<string, Array_>} split @param {number} from @param {number} to */
  const rows = (split, from, to) => ({
    images: new ort.Tensor('uint8', /** @type {Uint8Array} */ (split.images.data).slice(from * 64, to * 64), [to - from, 8, 8]),
    labels: new ort.Tensor('int64', /** @type {BigInt64Array} */ (split.labels.data).slice(from, to), [to - from]),
  });
  const train = readNpz(new URL('train.npz', DATA));
  const test = readNpz(new URL('test.npz', DATA));
  const count = train.labels.shape[0];
  const batches = [];
  for (let epoch = 0; epoch < epochs; epoch++) {
    for (let from = 0; from < count; from += batch) batches.push(rows(train, from, Math.min(count, from + batch)));
  }
  return { batches, test: rows(test, 0, test.labels.shape[0]) };
}

/** The share of rows whose largest logit is at their label.
 * @param {import('onnxruntime-common').Tensor} logits [n, classes]
 * @param {import('onnxruntime-common').Tensor} labels [n] */
export function accuracy(logits, labels) {
  const [rows, classes] = logits.dims;
  const values = /** @type {Float32Array} */ (logits.data);
  let right = 0;
  for (let row = 0; row < rows; row++) {
    const scores = values.subarray(row * classes, (row + 1) * classes);
    if (BigInt(scores.indexOf(Math.max(...scores))) === labels.data[row]) right++;
  }
  return right / rows;
}
