// Text into training rows as graphforge's text data packs the `text` format
// (graphforge/train/text/rows.py, plan 1): each sample's ids (the tokenizer's special tokens
// added, the EOS appended where it is not last), the samples one after another, cut every
// seqLen tokens. input_ids; labels, the next token of the same sample (the ignore index at a
// sample's last token and at padding: a label never crosses into the next sample);
// attention_mask, 1 on tokens and 0 on the last row's padding; position_ids, from 0 in each
// piece of a sample in a row.

export const IGNORE_INDEX = -100;

/** The samples of a pasted text: its paragraphs (split at blank lines), trimmed, none empty. */
export function samplesOf(text) {
  return text.split(/\n\s*\n/).map((s) => s.trim()).filter((s) => s.length > 0);
}

/** Each sample's ids, as graphforge's text data reads a `text` line. */
export function tokenize(tokenizer, samples, eosId) {
  return samples.map((sample) => {
    const ids = tokenizer.encode(sample).ids.map(Number);
    if (eosId !== null && ids.at(-1) !== eosId) ids.push(eosId);
    return ids;
  });
}

/** The rows of ``tokenized`` (lists of ids), each array [rows * seqLen] (row-major), rows
 * holding no label left out. */
export function pack(tokenized, seqLen, padId) {
  const tokens = tokenized.flat();
  const starts = new Array(tokens.length);
  const ends = new Array(tokens.length);
  let at = 0;
  for (const ids of tokenized) {
    for (let j = 0; j < ids.length; j++) [starts[at + j], ends[at + j]] = [at, at + ids.length];
    at += ids.length;
  }
  const rows = [];
  for (let begin = 0; begin < tokens.length; begin += seqLen) {
    const row = { input_ids: [], labels: [], attention_mask: [], position_ids: [] };
    for (let t = 0; t < seqLen; t++) {
      const g = begin + t;
      const real = g < tokens.length;
      row.input_ids.push(real ? tokens[g] : padId);
      row.labels.push(real && g + 1 < ends[g] ? tokens[g + 1] : IGNORE_INDEX);
      row.attention_mask.push(real ? 1 : 0);
      row.position_ids.push(real ? g - Math.max(begin, starts[g]) : 0);
    }
    if (row.labels.some((l) => l !== IGNORE_INDEX)) rows.push(row);
  }
  return rows;
}

/** The rows split into training rows and the held-out last ``fraction`` (at least one each,
 * at most ``most`` held out: they are scored in one run). */
export function split(rows, fraction, most = 64) {
  if (rows.length < 2) return null;
  const held = Math.min(rows.length - 1, most, Math.max(1, Math.round(rows.length * fraction)));
  return { train: rows.slice(0, rows.length - held), heldOut: rows.slice(rows.length - held) };
}
