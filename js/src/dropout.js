// The key of one run's Dropout masks, as graphforge's Python runtime computes it
// (graphforge/runtime/dropout.py, run_key): SplitMix64 of (seed, step, micro-batch, replica),
// split into two 32-bit words. The artifacts' masks are a pure function of the key.
const MASK = (1n << 64n) - 1n;

/** @param {bigint} x */
function splitmix64(x) {
  x = (x + 0x9e3779b97f4a7c15n) & MASK;
  x = ((x ^ (x >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK;
  x = ((x ^ (x >> 27n)) * 0x94d049bb133111ebn) & MASK;
  return x ^ (x >> 31n);
}

/** The uint32[2] key of the run at ``step`` (optimizer steps done), ``microBatch`` (training
 * runs since the last step) and data-parallel ``replica``.
 * @param {number | bigint} seed
 * @param {number} step
 * @param {number} microBatch
 * @param {number} [replica]
 * @returns {Uint32Array} */
export function runKey(seed, step, microBatch, replica = 0) {
  let x =
    BigInt(seed) * 0x9e3779b97f4a7c15n +
    BigInt(step) * 0xd1b54a32d192ed03n +
    BigInt(microBatch) * 0x8cb92ba72f3d8dd7n +
    BigInt(replica) * 0xa0761d6478bd642fn;
  x = splitmix64(x & MASK);
  return new Uint32Array([Number(x & 0xffffffffn), Number(x >> 32n)]);
}
