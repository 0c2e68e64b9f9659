// Train the digits MLP in the page: graphforge's JavaScript runtime on onnxruntime-web.
// Query parameters (for tests and tinkering): artifacts, data (where serve.py put them),
// epochs, batch, shuffle=0 (batches in order), steps (stop after so many), autostart=1,
// fresh=1 (ignore the checkpoint IndexedDB keeps), threads, backend=wasm|webgpu.
import * as ort from '/js/node_modules/onnxruntime-web/dist/ort.all.bundle.min.mjs';
import { CheckpointState, TrainingSession, makeSchedule, scheduleFromState } from '/js/src/index.js';
import { chartFrame, keeper, lossLine, offer } from './shared.js';

const params = new URLSearchParams(location.search);
const ARTIFACTS = params.get('artifacts') ?? '/out/web/artifacts/';
const DATA = params.get('data') ?? '/out/web/';
const BATCH = Number(params.get('batch') ?? 32);
const SHUFFLE = params.get('shuffle') !== '0';
const STOP_AFTER = params.has('steps') ? Number(params.get('steps')) : Infinity;
const WARMUP = 30; // as make demo's config (examples/digits/train.toml)
const DOT = 4; // the accuracy points' radius
const DB = 'graphforge-digits';

ort.env.wasm.wasmPaths = '/js/node_modules/onnxruntime-web/dist/';
ort.env.wasm.numThreads = Number(params.get('threads') ?? (self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1));

/** What the page did, for whoever drives it (tests read it). */
const log = (window.graphforge = { losses: [], accuracies: [], accuracy: null, step: 0, done: false, resumedAt: null, error: null, fallbackNodes: null, chart: null });
const $ = (id) => document.getElementById(id);
const status = (text) => ($('status').textContent = text);

let session, schedule, data, totalSteps, running = false;

window.addEventListener('error', (event) => fail(event.error ?? event.message));
window.addEventListener('unhandledrejection', (event) => fail(event.reason));

function fail(error) {
  log.error = String(error?.message ?? error);
  status(`error: ${log.error}`);
  running = false;
}

async function loadData() {
  const [index, bytes] = await Promise.all([
    fetch(`${DATA}digits.json`).then((r) => r.json()),
    fetch(`${DATA}digits.bin`).then((r) => r.arrayBuffer()),
  ]);
  const arrays = { uint8: Uint8Array, int64: BigInt64Array };
  const take = (key) => {
    const { dtype, shape, offset } = index[key];
    const count = shape.reduce((a, b) => a * b, 1);
    return { data: new arrays[dtype](bytes, offset, count), shape };
  };
  return { train: { images: take('train/images'), labels: take('train/labels') }, test: { images: take('test/images'), labels: take('test/labels') } };
}

// ------------------------------------------------------------------ the checkpoint IndexedDB keeps

const kept = keeper(DB, 'checkpoints');

async function keep() {
  session.checkpointState.scheduler = schedule.stateDict();
  await kept('put', { bytes: session.checkpointBytes(), accuracies: log.accuracies, losses: log.losses });
}

// ------------------------------------------------------------------ setting up

async function start() {
  data = await loadData();
  const backend = params.get('backend') ?? 'wasm';
  if (navigator.gpu) $('backend').append(new Option('webgpu', 'webgpu'));
  $('backend').value = backend;
  const saved = params.get('fresh') === '1' ? undefined : await kept('get');
  await open(saved, backend);
  $('train').onclick = () => train();
  $('pause').onclick = () => (running = false);
  $('download').onclick = download;
  $('forget').onclick = async () => {
    await kept('delete');
    location.search = '';
  };
  $('backend').onchange = async () => {
    await session.release();
    await open(undefined, $('backend').value);
  };
  if (params.get('autostart') === '1') train();
}

async function open(saved, backend) {
  const options = { executionProviders: backend === 'webgpu' ? ['webgpu', 'wasm'] : ['wasm'] };
  const checkpointState = saved ? CheckpointState.fromBytes(saved.bytes, 'the checkpoint this browser kept') : undefined;
  session = await watchingPlacements(backend, () => TrainingSession.create({ ort, artifacts: ARTIFACTS, ...(checkpointState ? { checkpointState } : {}) }, options));
  const epochs = Number(params.get('epochs') ?? $('epochs').value);
  $('epochs').value = String(epochs);
  totalSteps = epochs * Math.ceil(data.train.labels.shape[0] / BATCH);
  const state = session.checkpointState;
  if (saved && state.scheduler) {
    schedule = scheduleFromState(state.scheduler, session);
    totalSteps = state.scheduler.total_steps;
    log.losses = saved.losses;
    log.accuracies = saved.accuracies;
    log.accuracy = saved.accuracies.at(-1)?.accuracy ?? null;
    log.resumedAt = state.step;
  } else {
    schedule = makeSchedule('cosine', session, { warmupSteps: WARMUP, totalSteps });
  }
  log.step = state.step;
  $('download').disabled = false;
  draw();
  status(saved ? `resumed at step ${state.step} of ${totalSteps} (the checkpoint this browser kept)` : `ready: ${totalSteps} steps of ${BATCH} (${backend})`);
}

/** Create the sessions; on WebGPU, name the nodes onnxruntime placed on its CPU (wasm) kernels. */
async function watchingPlacements(backend, create) {
  if (backend !== 'webgpu') return create();
  const lines = [];
  const original = console.log;
  console.log = (...args) => {
    lines.push(args.join(' '));
    original(...args);
  };
  ort.env.logLevel = 'verbose';
  try {
    return await create();
  } finally {
    console.log = original;
    ort.env.logLevel = 'warning';
    const names = lines.filter((l) => /Node name:/.test(l)).map((l) => l.replace(/.*Op Type: ?/, ''));
    const onCpu = lines.some((l) => /placed on \[CPUExecutionProvider\]/.test(l));
    log.fallbackNodes = onCpu ? names : [];
    $('fallback').textContent = onCpu ? `on wasm, not WebGPU (${names.length} nodes):\n${names.join('\n')}` : 'every node runs on WebGPU';
  }
}

// ------------------------------------------------------------------ training

function order(epoch) {
  const count = data.train.labels.shape[0];
  const indices = Array.from({ length: count }, (_, i) => i);
  if (!SHUFFLE) return indices;
  let seed = (epoch + 1) * 0x9e3779b9;
  const random = () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  for (let i = count - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [indices[i], indices[j]] = [indices[j], indices[i]];
  }
  return indices;
}

function batchOf(indices) {
  const { images, labels } = data.train;
  const x = new Uint8Array(indices.length * 64);
  const y = new BigInt64Array(indices.length);
  indices.forEach((index, row) => {
    x.set(images.data.subarray(index * 64, index * 64 + 64), row * 64);
    y[row] = labels.data[index];
  });
  return { images: new ort.Tensor('uint8', x, [indices.length, 8, 8]), labels: new ort.Tensor('int64', y, [indices.length]) };
}

async function evaluate() {
  const { images, labels } = data.test;
  const out = await session.runEvalStep({
    images: new ort.Tensor('uint8', images.data, images.shape),
    labels: new ort.Tensor('int64', labels.data, labels.shape),
  });
  const logits = out.logits.data;
  let right = 0;
  for (let row = 0; row < labels.shape[0]; row++) {
    let best = 0;
    for (let c = 1; c < 10; c++) if (logits[row * 10 + c] > logits[row * 10 + best]) best = c;
    if (BigInt(best) === labels.data[row]) right++;
  }
  return { loss: Number(out.loss.data[0]), accuracy: right / labels.shape[0] };
}

async function train() {
  if (running) return;
  running = true;
  $('train').disabled = true;
  $('pause').disabled = false;
  const perEpoch = Math.ceil(data.train.labels.shape[0] / BATCH);
  const started = performance.now();
  let ran = 0;
  while (running && session.checkpointState.step < totalSteps && ran < STOP_AFTER) {
    const step = session.checkpointState.step;
    const epoch = Math.floor(step / perEpoch);
    const at = (step % perEpoch) * BATCH;
    const indices = order(epoch).slice(at, at + BATCH);
    const out = await session.runTrainStep(batchOf(indices));
    await session.runOptimizerStep();
    session.lazyResetGrad();
    schedule.step();
    session.checkpointState.dataPosition = { epoch, batch: (step % perEpoch) + 1 };
    log.losses.push(Number(out.loss.data[0]));
    log.step = session.checkpointState.step;
    ran++;
    if (log.step % perEpoch === 0 || log.step === totalSteps) {
      const result = await evaluate();
      log.accuracies.push({ step: log.step, ...result });
      log.accuracy = result.accuracy;
      await keep();
    }
    if (ran % 15 === 0 || !running) {
      draw();
      const rate = (ran * BATCH) / ((performance.now() - started) / 1000);
      status(`step ${log.step}/${totalSteps}  loss ${log.losses.at(-1).toFixed(4)}  test accuracy ${log.accuracy?.toFixed(4) ?? '—'}  ${rate.toFixed(0)} samples/s`);
      await new Promise((resolve) => setTimeout(resolve)); // let the page draw
    }
  }
  await keep();
  draw();
  running = false;
  $('train').disabled = log.step >= totalSteps;
  $('pause').disabled = true;
  if (log.step >= totalSteps || ran >= STOP_AFTER) {
    status(`done: step ${log.step}, test accuracy ${log.accuracy?.toFixed(4) ?? '—'}`);
    log.done = true;
  }
}

function download() {
  session.checkpointState.scheduler = schedule.stateDict();
  offer(session.checkpointBytes(), `digits-step${session.checkpointState.step}.ckpt`);
}

// ------------------------------------------------------------------ the chart

function draw() {
  const { g, x, top, bottom, labels } = chartFrame($('chart'), {
    left: ['training loss', '#1f6feb'],
    right: ['test accuracy (0 to 1)', '#e36209'],
    caption: `step ${log.step} of ${totalSteps}`,
    total: totalSteps,
  });
  g.textAlign = 'left';
  const most = Math.max(2.5, ...log.losses);
  const yLoss = (loss) => top + (bottom - top) * (1 - loss / most);
  const yAcc = (acc) => top + (bottom - top) * (1 - acc);
  lossLine(g, x, yLoss, log.losses, '#1f6feb');
  g.fillStyle = '#e36209';
  const dots = [];
  for (const { step, accuracy } of log.accuracies) {
    g.beginPath();
    g.arc(x(step), yAcc(accuracy), DOT, 0, 2 * Math.PI);
    g.fill();
    dots.push({ x: x(step), y: yAcc(accuracy), r: DOT });
  }
  log.chart = { labels, dots }; // where the drawing put them, for whoever drives the page
}

start().catch(fail);
