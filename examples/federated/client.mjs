// One client of examples/federated/server.py: each round, the global parameters in, an epoch
// on its own shard with graphforge's JavaScript runtime (onnxruntime-node), its parameters and
// sample count back.
//   node examples/federated/client.mjs http://127.0.0.1:8001 NAME [--send=wrong-size|not-finite]
// (--send makes a client that misbehaves, for the server to refuse.)
import { createRequire } from 'node:module';
import { TrainingSession } from '../../js/src/index.js';

// onnxruntime-node as js/ installed it (make install's npm ci)
const ort = (() => {
  try {
    return createRequire(new URL('../../js/package.json', import.meta.url))('onnxruntime-node');
  } catch {
    console.error('onnxruntime-node is missing: run make install first (it runs npm ci in js/)');
    process.exit(2);
  }
})();

const [server, name, ...flags] = process.argv.slice(2);
const misbehave = flags.find((f) => f.startsWith('--send='))?.slice('--send='.length);
const BATCH = 32;
const session = await TrainingSession.create({ ort, artifacts: `${server}/files/artifacts/` }, { intraOpNumThreads: 1 });
const shard = misbehave ? null : await loadShard();

async function loadShard() {
  const index = await (await fetch(`${server}/files/shard-${name}.json`)).json();
  const bytes = await (await fetch(`${server}/files/shard-${name}.bin`)).arrayBuffer();
  return {
    count: index.count,
    images: new Uint8Array(bytes, index.images, index.count * 64),
    labels: new BigInt64Array(bytes, index.labels, index.count),
  };
}

async function epoch() {
  for (let start = 0; start < shard.count; start += BATCH) {
    const rows = Math.min(BATCH, shard.count - start);
    await session.runTrainStep({
      images: new ort.Tensor('uint8', shard.images.slice(start * 64, (start + rows) * 64), [rows, 8, 8]),
      labels: new ort.Tensor('int64', shard.labels.slice(start, start + rows), [rows]),
    });
    await session.runOptimizerStep();
    session.lazyResetGrad();
  }
}

for (let round = 0; ; round++) {
  const response = await fetch(`${server}/round?wait=${round}`);
  const open = Number(response.headers.get('X-Round'));
  if (open >= Number(response.headers.get('X-Rounds'))) break;
  await session.loadParametersBuffer(new Uint8Array(await response.arrayBuffer()));
  let body;
  if (misbehave === 'wrong-size') body = new Uint8Array(12);
  else {
    if (!misbehave) await epoch();
    const values = (await session.getContiguousParameters()).data;
    if (misbehave === 'not-finite') values[7] = Number.NaN;
    body = new Uint8Array(values.buffer, values.byteOffset, values.byteLength);
  }
  const samples = shard ? shard.count : 100;
  const answer = await fetch(`${server}/update?client=${name}&round=${round}&samples=${samples}`, { method: 'POST', body });
  if (!answer.ok && !misbehave) throw new Error(`round ${round}: ${await answer.text()}`);
}
await session.release();
