// The timed loop of benchmarks/ondevice_bench.py, the same in Node and in the browser: one side
// (graphforge's runtime on an onnxruntime namespace, or TensorFlow.js on one of its backends)
// trains one model on the batches Python wrote, and the time of each block of steps comes back.
// The libraries come in from the caller (node.mjs or page.mjs), as does `load`, which reads a
// file (Node) or fetches a URL (browser) and gives its bytes.
//
// In Node, `gcClock` gives the milliseconds V8 has spent collecting garbage so far.
//
// A job: {side: "graphforge" | "tfjs", backend, threads, artifacts, model: {kind, ...},
//         weights: {file, tensors: [{name, shape, offset}]}, batches: {file, steps: [...]},
//         warmup, warmupSeconds, blocks, blockSeconds}
import { TrainingSession, runKey } from '../../js/src/index.js';

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, uint8: Uint8Array, int32: Int32Array };

function slice(bytes, t) {
  return bytes.slice(t.offset, t.offset + t.bytes);
}

/** The milliseconds a step of each timed block, and the losses of the first steps, for
 * ``step(i)``: warm-up steps (``warmup`` of them, and for ``warmupSeconds`` at least: V8
 * compiles a large wasm module's optimized code in the background for seconds), then
 * ``blocks`` blocks each of as many steps as take about ``blockSeconds`` (at least one), going
 * by the warm-up's last step. */
async function timed(job, step, gcClock = null) {
  const losses = [];
  let last = 0;
  let next = 0;
  const begun = performance.now();
  while (next < job.warmup || performance.now() - begun < (job.warmupSeconds ?? 0) * 1000) {
    const started = performance.now();
    const loss = await step(next++);
    if (losses.length < 5) losses.push(loss);
    last = performance.now() - started;
  }
  const count = Math.max(1, Math.round((job.blockSeconds * 1000) / Math.max(last, 1e-3)));
  const blocks = [];
  const collected = gcClock?.();
  for (let b = 0; b < job.blocks; b++) {
    const started = performance.now();
    for (let i = 0; i < count; i++) await step(next++);
    blocks.push((performance.now() - started) / count);
  }
  const result = { blocks, losses };
  if (gcClock) {
    await new Promise((resolve) => setTimeout(resolve, 0)); // the last collections' entries
    result.gcMsPerStep = (gcClock() - collected) / (count * job.blocks);
  }
  return result;
}

async function graphforge(job, { ort, load, gcClock }) {
  const options =
    job.backend === 'web'
      ? { executionProviders: ['wasm'] }
      : { executionProviders: ['cpu'], intraOpNumThreads: job.threads, interOpNumThreads: 1 };
  if (job.backend === 'web') ort.env.wasm.numThreads = job.threads;
  const bytes = await load(job.batches.file);
  const batches = job.batches.steps.map((step) =>
    Object.fromEntries(step.map((t) => [t.name, new ort.Tensor(t.dtype, new ARRAYS[t.dtype](slice(bytes, t)), t.shape)])),
  );
  const session = await TrainingSession.create({ ort, artifacts: job.artifacts }, options);
  const loss = session.manifest.loss;
  const result = await timed(job, async (i) => Number((await session.runStep(batches[i % batches.length]))[loss].data[0]), gcClock);
  result.bare = await bare(job, session, batches, { ort, load, options });
  await session.release();
  return result;
}

/** The whole-step model run bare, in a session of its own with the same options, the
 * session's state fed and nothing carried: fetching every output (what a step does), fetching
 * them into outputs allocated once, and fetching the loss alone (the run computes the same; the
 * carried tensors stay in onnxruntime). The first two less the third is what handing the
 * carried tensors to JavaScript costs; the step less the first is what the runtime adds. */
async function bare(job, session, batches, { ort, load, options }) {
  const entry = session.manifest.models.train_step;
  const model = await ort.InferenceSession.create(new Uint8Array(await load(`${job.artifacts.replace(/\/?$/, '/')}${entry.file}`)), options);
  const state = session.checkpointState;
  // each input as the manifest's role says (docs/ondevice-manifest.md), the batch the first one
  const scalars = {
    reset: () => new ort.Tensor('bool', Uint8Array.of(1), []),
    lr: () => new ort.Tensor('float32', Float32Array.of(session.getLearningRate()), []),
    step: () => new ort.Tensor('int64', BigInt64Array.of(BigInt(state.step)), []),
    dropout_key: () => new ort.Tensor('uint32', runKey(state.seeds.dropout ?? session.manifest.dropout?.seed ?? 0, state.step, 0), [2]),
  };
  const feeds = {};
  for (const port of entry.inputs) {
    const t = port.role === 'state' ? state.tensor(port.state) : null;
    feeds[port.name] = t ? new ort.Tensor(t.dtype, t.data, t.shape) : port.role in scalars ? scalars[port.role]() : batches[0][port.name];
  }
  const into = {};
  for (const port of entry.outputs) {
    const t = port.state ? session.checkpointState.tensor(port.state) : null;
    into[port.name] = t ? new ort.Tensor(t.dtype, new t.data.constructor(t.data.length), t.shape) : null;
  }
  const time = async (run) => (await timed({ ...job, blocks: 1 }, async () => (await run(), 0))).blocks[0];
  const result = {
    all: await time(() => model.run(feeds)),
    into: await time(() => model.run(feeds, into)),
    lossOnly: await time(() => model.run(feeds, [session.manifest.loss])),
  };
  await model.release();
  return result;
}

// ------------------------------------------------------------------ TensorFlow.js

function layers(tf, spec) {
  const model = tf.sequential();
  if (spec.kind === 'mlp') {
    spec.sizes.slice(1).forEach((units, i) => {
      const last = i === spec.sizes.length - 2;
      model.add(tf.layers.dense({ units, activation: last ? 'linear' : 'relu', ...(i === 0 ? { inputShape: [spec.sizes[0]] } : {}) }));
    });
  } else {
    let first = true;
    for (const conv of spec.convs) {
      model.add(tf.layers.conv2d({ filters: conv.filters, kernelSize: conv.kernel, activation: 'relu', ...(first ? { inputShape: spec.input } : {}) }));
      model.add(tf.layers.maxPooling2d({ poolSize: 2, strides: 2 }));
      first = false;
    }
    model.add(tf.layers.flatten());
    model.add(tf.layers.dense({ units: spec.classes }));
  }
  return model;
}

async function tfjs(job, { tf, tfWasm, load, wasmPaths }) {
  if (job.backend === 'wasm') {
    if (wasmPaths) tfWasm.setWasmPaths(wasmPaths);
    tfWasm.setThreadsCount(job.threads);
  }
  if (!(await tf.setBackend(job.backend))) throw new Error(`TensorFlow.js could not start its ${job.backend} backend`);
  await tf.ready();
  const spec = job.model;
  const model = layers(tf, spec);
  const weights = await load(job.weights.file);
  model.setWeights(job.weights.tensors.map((t) => tf.tensor(new Float32Array(slice(weights, t)), t.shape)));
  const bytes = await load(job.batches.file);
  const batches = job.batches.steps.map((step) => {
    const [x, labels] = step;
    const values = new ARRAYS[x.dtype](slice(bytes, x));
    // TensorFlow.js has no uint8 tensors: the digits' pixels come as int32 and are scaled in the step
    const input = x.dtype === 'uint8' ? tf.tensor(Int32Array.from(values), x.shape, 'int32') : tf.tensor(values, x.shape);
    const classes = Int32Array.from(new ARRAYS[labels.dtype](slice(bytes, labels)), Number);
    return { x: input, y: tf.oneHot(tf.tensor1d(classes, 'int32'), spec.classes) };
  });
  const optimizer = tf.train.adam(job.lr, 0.9, 0.999, 1e-8);
  const prepare = (x) =>
    spec.scale ? x.toFloat().mul(spec.scale).reshape([x.shape[0], -1]) : spec.kind === 'cnn' ? x.reshape([x.shape[0], ...spec.input]) : x;
  const result = await timed(job, async (i) => {
    const { x, y } = batches[i % batches.length];
    const loss = optimizer.minimize(() => tf.losses.softmaxCrossEntropy(y, model.apply(prepare(x), { training: true })), true);
    const value = (await loss.data())[0];
    loss.dispose();
    return value;
  });
  if (job.backend === 'wasm') {
    result.threads = tfWasm.getThreadsCount();
    result.multithread = await tf.env().getAsync('WASM_HAS_MULTITHREAD_SUPPORT');
    result.matmul = await matmulRates(tf);
  }
  return result;
}

/** GFLOP/s of a [64, 1024] × [1024, 1024] MatMul on the backend, plain and with either operand
 * transposed (a backward pass's MatMuls take one operand transposed). */
async function matmulRates(tf) {
  const rates = {};
  for (const [name, a, b, ta, tb] of [
    ['plain', [64, 1024], [1024, 1024], false, false],
    ['first transposed', [1024, 64], [1024, 1024], true, false],
    ['second transposed', [64, 1024], [1024, 1024], false, true],
  ]) {
    const x = tf.randomNormal(a);
    const y = tf.randomNormal(b);
    const once = async () => {
      const z = tf.matMul(x, y, ta, tb);
      await z.data();
      z.dispose();
    };
    await once();
    const started = performance.now();
    let count = 0;
    while (performance.now() - started < 300 || count < 2) {
      await once();
      count++;
    }
    rates[name] = (2 * 64 * 1024 * 1024 * count) / ((performance.now() - started) * 1e6);
    tf.dispose([x, y]);
  }
  return rates;
}

export async function measure(job, libraries) {
  return job.side === 'tfjs' ? tfjs(job, libraries) : graphforge(job, libraries);
}
