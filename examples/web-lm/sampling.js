// Choosing the next token as graphforge/generate/sampling.py does, so that the page and
// graphforge.generate.Generator give the same tokens for the same logits, settings and seed:
// greedy (the first largest logit), or temperature, top-k and top-p (in that order, float32
// arithmetic) then one draw from softmax (float64) with one uniform from numpy's
// Generator(Philox(key=seed)): Philox4x64-10, its random() = (next uint64 >> 11) · 2⁻⁵³.

const MASK = (1n << 64n) - 1n;
const M0 = 0xd2e7470ee14c6c93n;
const M1 = 0xca5a826395121157n;
const W0 = 0x9e3779b97f4a7c15n;
const W1 = 0xbb67ae8584caa73bn;

/** numpy's Philox bit generator with ``key`` = [seed mod 2⁶⁴, seed >> 64] and a zero counter. */
export class Philox {
  constructor(seed) {
    const s = BigInt(seed);
    if (s < 0n || s >= 1n << 128n) throw new RangeError(`a Philox seed lies in [0, 2**128), got ${seed}`);
    this.key = [s & MASK, s >> 64n];
    this.counter = [0n, 0n, 0n, 0n];
    this.buffer = [];
  }

  /** The next uint64 (a BigInt): numpy bumps the counter, then runs the 10 rounds on it. */
  nextUint64() {
    if (this.buffer.length === 0) {
      for (let i = 0; i < 4; i++) {
        this.counter[i] = (this.counter[i] + 1n) & MASK;
        if (this.counter[i] !== 0n) break;
      }
      this.buffer = block(this.counter, this.key).reverse();
    }
    return this.buffer.pop();
  }

  /** A float64 in [0, 1), as numpy's Generator.random(). */
  random() {
    return Number(this.nextUint64() >> 11n) * 2 ** -53;
  }
}

function block(counter, key) {
  let [c0, c1, c2, c3] = counter;
  let [k0, k1] = key;
  for (let round = 0; round < 10; round++) {
    if (round > 0) [k0, k1] = [(k0 + W0) & MASK, (k1 + W1) & MASK];
    const p0 = M0 * c0;
    const p1 = M1 * c2;
    [c0, c1, c2, c3] = [(p1 >> 64n) ^ c1 ^ k0, p1 & MASK, (p0 >> 64n) ^ c3 ^ k1, p0 & MASK];
  }
  return [c0, c1, c2, c3];
}

/** The index of the first largest value (numpy's argmax). */
export function argmax(values) {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

/** ``logits`` divided by the temperature (float32), every token outside the top k and the
 * nucleus top p set to -Infinity (sampling.py's ``filtered``). */
export function filtered(logits, temperature = 1, topK = null, topP = null) {
  const t = Math.fround(temperature);
  let scores = Float32Array.from(logits, (l) => l / t);
  if (topK !== null) {
    const k = Math.min(topK, scores.length);
    const kth = Float32Array.from(scores).sort()[scores.length - k];
    scores = scores.map((s) => (s < kth ? -Infinity : s));
  }
  if (topP !== null) scores = nucleus(scores, topP);
  return scores;
}

function nucleus(scores, topP) {
  // ascending, ties in index order (a stable sort); the tokens whose cumulative probability
  // stays at or below 1 - top_p go, the most likely one always stays
  const order = Array.from(scores, (_, i) => i).sort((a, b) => scores[a] - scores[b] || a - b);
  const most = scores[order.at(-1)];
  const exps = order.map((i) => Math.fround(Math.exp(Math.fround(scores[i] - most))));
  const total = exps.reduce((a, b) => Math.fround(a + b), 0);
  const limit = Math.fround(1 - topP);
  const out = Float32Array.from(scores);
  let cumulative = 0;
  for (let j = 0; j < order.length - 1; j++) {
    cumulative = Math.fround(cumulative + Math.fround(exps[j] / total));
    if (cumulative <= limit) out[order[j]] = -Infinity;
  }
  return out;
}

/** One token drawn from softmax(``scores``) in float64 with one uniform of ``rng``. */
export function draw(scores, rng) {
  let most = -Infinity;
  for (const s of scores) most = Math.max(most, s);
  const exps = Array.from(scores, (s) => Math.exp(s - most));
  const total = exps.reduce((a, b) => a + b, 0);
  const cumulative = [];
  let sum = 0;
  for (const e of exps) cumulative.push((sum += e / total));
  const u = rng.random() * cumulative.at(-1);
  let index = cumulative.findIndex((c) => c > u);
  if (index < 0) index = cumulative.length - 1;
  return index;
}

/** How the next token is chosen: greedy unless temperature, topK or topP is given (sampling.py's Sampling). */
export class Sampling {
  constructor({ temperature = null, topK = null, topP = null, seed = 0 } = {}) {
    Object.assign(this, { temperature, topK, topP, seed });
  }

  get greedy() {
    return this.temperature === 0 || (this.temperature === null && this.topK === null && this.topP === null);
  }

  rng() {
    return new Philox(this.seed);
  }

  choose(logits, rng) {
    if (this.greedy) return argmax(logits);
    return draw(filtered(logits, this.temperature ?? 1, this.topK, this.topP), rng);
  }
}
