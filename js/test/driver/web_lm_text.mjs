// The web-lm page's text and sampling code in Node, for tests/ondevice/test_web_lm.py. One
// argument, a JSON job: {tokenizers: [folder, ...], texts and samples: files of a JSON list of
// strings, seqLen, seeds: [seed, ...], draws, choices: [{logits, temperature, topK, topP, seed,
// count}]}. Prints one JSON line: each tokenizer's ids of every text (@huggingface/tokenizers)
// and the rows the page packs the samples into, each seed's first uniforms, each choice's tokens.
import fs from 'node:fs';
import path from 'node:path';
import { Tokenizer } from '@huggingface/tokenizers';
import { pack, tokenize } from '../../../examples/web-lm/rows.js';
import { Philox, Sampling } from '../../../examples/web-lm/sampling.js';

const job = JSON.parse(process.argv[2]);
const texts = JSON.parse(fs.readFileSync(job.texts, 'utf8'));
const samples = JSON.parse(fs.readFileSync(job.samples, 'utf8'));
const read = (folder, name) => JSON.parse(fs.readFileSync(path.join(folder, name), 'utf8'));
const out = { ids: [], rows: [], uniforms: {}, choices: [] };
for (const folder of job.tokenizers) {
  const config = read(folder, 'tokenizer_config.json');
  const tokenizer = new Tokenizer(read(folder, 'tokenizer.json'), config);
  out.ids.push(texts.map((text) => tokenizer.encode(text).ids));
  const eos = tokenizer.token_to_id(config.eos_token) ?? null;
  out.rows.push(pack(tokenize(tokenizer, samples, eos), job.seqLen, eos ?? 0));
}
for (const seed of job.seeds) {
  const rng = new Philox(BigInt(seed));
  out.uniforms[seed] = Array.from({ length: job.draws }, () => rng.random());
}
for (const { logits, temperature, topK, topP, seed, count } of job.choices) {
  const sampling = new Sampling({ temperature, topK, topP, seed });
  const rng = sampling.rng();
  const row = Float32Array.from(logits);
  out.choices.push(Array.from({ length: count }, () => sampling.choose(row, rng)));
}
console.log(JSON.stringify(out));
