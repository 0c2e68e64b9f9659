// Fine-tune a small language model in the page: LoRA adapters (the base frozen) trained by
// graphforge's JavaScript runtime on onnxruntime-web, the text tokenized here by
// @huggingface/tokenizers from the model's own tokenizer.json, generation as graphforge's
// Generator does it (sampling.js). Query parameters (for tests and tinkering): base (where
// serve.py put its files), text (a URL of text to train on), seq, batch, steps, prompt, new
// (tokens to generate), temperature, top_k, top_p, seed, autostart=1 (generate, train,
// generate), fresh=1 (ignore what IndexedDB keeps), generate=1 (generate once loaded, before
// autostart's training), threads.
import * as ort from '/js/node_modules/onnxruntime-web/dist/ort.wasm.bundle.min.mjs'; // wasm alone
import { Tokenizer } from '/js/node_modules/@huggingface/tokenizers/dist/tokenizers.mjs';
import { CheckpointState, TrainingSession, makeSchedule, scheduleFromState } from '/js/src/index.js';
import { chartFrame, keeper, lossLine, offer } from '../web/shared.js';
import { pack, samplesOf, split, tokenize } from './rows.js';
import { Sampling } from './sampling.js';

const params = new URLSearchParams(location.search);
const BASE = params.get('base') ?? '/out/web-lm/';
const SEQ = Number(params.get('seq') ?? 32);
const BATCH = Number(params.get('batch') ?? 8);
const NEW = Number(params.get('new') ?? 32);
const HELD_OUT = 0.1; // the last tenth of the rows
const EVAL_EVERY = 10;
const DB = 'graphforge-web-lm';
const number = (key) => (params.has(key) ? Number(params.get(key)) : null);

ort.env.wasm.wasmPaths = '/js/node_modules/onnxruntime-web/dist/';
ort.env.wasm.numThreads = Number(params.get('threads') ?? (self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency) : 1));

/** What the page did, for whoever drives it (tests read it). */
const log = (window.graphforge = { losses: [], heldOut: [], rows: null, before: null, after: null, generated: null, settled: false, step: 0, totalSteps: 0, done: false, resumedAt: null, error: null });
const $ = (id) => document.getElementById(id);
const status = (text) => ($('status').textContent = text);

let tokenizer, eosId, padId, session, generator, schedule, data = null, running = false;

window.addEventListener('error', (event) => fail(event.error ?? event.message));
window.addEventListener('unhandledrejection', (event) => fail(event.reason));

function fail(error) {
  log.error = String(error?.message ?? error);
  status(`error: ${log.error}`);
  running = false;
}

// ------------------------------------------------------------------ what IndexedDB keeps

const kept = keeper(DB, 'adapters');

/** The adapters (not the frozen base), the curves and the text, under the artifacts' checkpoint
 * digest: what was trained from other artifacts is not restored onto these. */
async function keep() {
  const { losses, heldOut, before, totalSteps } = log;
  const artifacts = session.manifest.checkpoint.sha256;
  await kept('put', { artifacts, bytes: adapterBytes(), losses, heldOut, before, totalSteps, text: $('text').value });
}

/** The kept adapters, their optimizer states and the step put into the session's state (each
 * tensor's type and shape checked); false where they do not fit these artifacts. */
function adopt(saved) {
  const state = session.checkpointState;
  if (saved.artifacts !== session.manifest.checkpoint.sha256) return false;
  const trained = CheckpointState.fromBytes(saved.bytes, 'the adapters this browser kept');
  for (const [name, { dtype, shape }] of trained.tensors) {
    const mine = state.tensors.get(name);
    if (!mine || mine.dtype !== dtype || String(mine.shape) !== String(shape)) return false;
  }
  for (const [name, tensor] of trained.tensors) state.tensors.set(name, tensor);
  const { step, learningRate, scheduler, seeds, dataPosition } = trained;
  Object.assign(state, { step, learningRate, scheduler, seeds, dataPosition });
  return true;
}

// ------------------------------------------------------------------ setting up

async function start() {
  const [json, config] = await Promise.all(['tokenizer.json', 'tokenizer_config.json'].map((f) => fetch(`${BASE}${f}`).then((r) => r.json())));
  tokenizer = new Tokenizer(json, config);
  const eos = typeof config.eos_token === 'string' ? config.eos_token : config.eos_token?.content;
  eosId = eos === undefined ? null : tokenizer.token_to_id(eos) ?? null;
  padId = eosId ?? 0; // as the Python side pads without a pad token
  [session, generator] = await Promise.all([
    TrainingSession.create({ ort, artifacts: `${BASE}artifacts/` }, { executionProviders: ['wasm'] }),
    ort.InferenceSession.create(`${BASE}generate.onnx`, { executionProviders: ['wasm'] }),
  ]);
  const saved = params.get('fresh') === '1' ? undefined : await kept('get');
  const restored = saved !== undefined && adopt(saved);
  if (restored) restore(saved);
  else if (params.has('text')) $('text').value = await fetch(params.get('text')).then((r) => r.text());
  wire();
  if (saved !== undefined && !restored) status('the adapters this browser kept were trained from other artifacts (serve.py wrote new ones): starting afresh');
  draw();
  if (params.get('generate') === '1') log.generated = await generate();
  if (params.get('autostart') === '1') await run();
  log.settled = true; // what the query asked for is done
}

function restore(saved) {
  Object.assign(log, { losses: saved.losses, heldOut: saved.heldOut, before: saved.before, totalSteps: saved.totalSteps });
  $('text').value = saved.text;
  schedule = scheduleFromState(session.checkpointState.scheduler, session);
  log.step = log.resumedAt = session.checkpointState.step;
  $('before').textContent = saved.before?.text ?? '';
  $('download').disabled = false;
  status(`restored the adapters of step ${log.step} (kept in this browser)`);
}

function wire() {
  const text = $('text');
  text.addEventListener('dragover', (event) => (event.preventDefault(), text.classList.add('dragging')));
  text.addEventListener('dragleave', () => text.classList.remove('dragging'));
  text.addEventListener('drop', async (event) => {
    event.preventDefault();
    text.classList.remove('dragging');
    const file = event.dataTransfer.files[0];
    if (file) text.value = await file.text();
  });
  $('train').onclick = () => run().catch(fail);
  $('pause').onclick = () => (running = false);
  $('generate').onclick = async () => (log.after = await generate().catch(fail));
  $('download').onclick = download;
  $('forget').onclick = async () => {
    await kept('delete');
    location.search = '';
  };
  for (const id of ['train', 'generate']) $(id).disabled = false;
  if (log.resumedAt === null) status('ready: paste or drop text, then Train');
}

// ------------------------------------------------------------------ text into rows

function rowsOf(text) {
  const rows = split(pack(tokenize(tokenizer, samplesOf(text), eosId), SEQ, padId), HELD_OUT);
  if (rows === null) throw new Error(`the text makes fewer than 2 rows of ${SEQ} tokens: paste more`);
  return rows;
}

/** The batch of ``rows``, as the training and eval models take it (only the inputs they have). */
function feeds(rows) {
  const names = session.manifest.models.training.inputs.filter((p) => p.role === 'batch' || p.role === 'labels').map((p) => p.name);
  const out = {};
  for (const name of names) {
    const key = name === session.manifest.labels ? 'labels' : name;
    if (!(key in rows[0])) throw new Error(`the training model takes an input ${name}, which text rows do not give`);
    out[name] = new ort.Tensor('int64', BigInt64Array.from(rows.flatMap((r) => r[key]), BigInt), [rows.length, SEQ]);
  }
  return out;
}

async function heldOutLoss() {
  const out = await session.runEvalStep(feeds(data.heldOut));
  return Number(out[session.manifest.loss].data[0]);
}

// ------------------------------------------------------------------ training

async function run() {
  if (running) return;
  data = rowsOf($('text').value);
  log.rows = { train: data.train.length, heldOut: data.heldOut.length };
  const steps = Number(params.get('steps') ?? $('steps').value);
  if (!schedule || session.checkpointState.step >= log.totalSteps) {
    log.totalSteps = session.checkpointState.step + steps;
    // from the pipeline's rate each time (the rate a finished schedule left is its end, 0)
    const baseLr = session.manifest.default_lr ?? session.getLearningRate();
    schedule = makeSchedule('cosine', session, { baseLr, warmupSteps: Math.min(10, Math.floor(steps / 10)), totalSteps: steps });
  }
  if (log.before === null) log.before = await generate($('before'));
  running = true;
  $('train').disabled = $('generate').disabled = true;
  $('pause').disabled = false;
  if (log.heldOut.length === 0 || log.heldOut.at(-1).step !== session.checkpointState.step) {
    log.heldOut.push({ step: session.checkpointState.step, loss: await heldOutLoss() });
  }
  const started = performance.now();
  let ran = 0;
  while (running && session.checkpointState.step < log.totalSteps) {
    const at = (session.checkpointState.step * BATCH) % data.train.length;
    const rows = Array.from({ length: BATCH }, (_, i) => data.train[(at + i) % data.train.length]);
    const out = await session.runTrainStep(feeds(rows));
    await session.runOptimizerStep();
    session.lazyResetGrad();
    schedule.step();
    log.losses.push(Number(out[session.manifest.loss].data[0]));
    log.step = session.checkpointState.step;
    ran++;
    if (log.step % EVAL_EVERY === 0 || log.step === log.totalSteps) log.heldOut.push({ step: log.step, loss: await heldOutLoss() });
    if (ran % 5 === 0 || log.step === log.totalSteps) {
      draw();
      const rate = (ran * BATCH * SEQ) / ((performance.now() - started) / 1000);
      status(`step ${log.step}/${log.totalSteps}  loss ${log.losses.at(-1).toFixed(3)}  held-out ${log.heldOut.at(-1).loss.toFixed(3)}  ${rate.toFixed(0)} tokens/s`);
      await new Promise((resolve) => setTimeout(resolve)); // let the page draw
    }
  }
  running = false;
  log.trainMs = performance.now() - started;
  log.after = await generate();
  await keep();
  draw();
  $('train').disabled = $('generate').disabled = false;
  $('pause').disabled = true;
  $('download').disabled = false;
  const [first, last] = [log.heldOut[0].loss, log.heldOut.at(-1).loss];
  status(`step ${log.step}: held-out loss ${first.toFixed(3)} → ${last.toFixed(3)} (${log.rows.train} training rows, ${log.rows.heldOut} held out)`);
  log.done = log.step >= log.totalSteps;
}

// ------------------------------------------------------------------ generation

/** The text after the prompt, with the adapters as trained so far (graphforge's Generator's
 * choices: greedy at temperature 0, else sampled with the seed's Philox stream). */
async function generate(into = $('after')) {
  const sampling = new Sampling({
    temperature: number('temperature') ?? (Number($('temperature').value) || null),
    topK: number('top_k'),
    topP: number('top_p'),
    seed: number('seed') ?? Number($('seed').value),
  });
  const prompt = params.get('prompt') ?? $('prompt').value;
  const promptIds = tokenizer.encode(prompt).ids.map(Number);
  if (promptIds.length === 0) throw new Error('the prompt gives no tokens');
  const ids = promptIds.slice();
  const fresh = [];
  const started = performance.now();
  const rng = sampling.rng();
  for (let count = 0; count < NEW; count++) {
    const token = sampling.choose(await nextLogits(ids), rng);
    fresh.push(token);
    ids.push(token);
    into.textContent = tokenizer.decode(fresh, { skip_special_tokens: true });
    if (token === eosId) break;
  }
  const ms = performance.now() - started;
  return { prompt, promptIds, ids: fresh, text: into.textContent, ms };
}

/** The logits [vocab] after ``ids``: the whole prefix run again, the adapters fed from the training state. */
async function nextLogits(ids) {
  const n = ids.length;
  const inputs = {};
  for (const name of generator.inputNames) {
    if (name === 'input_ids') inputs[name] = new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, n]);
    else if (name === 'attention_mask') inputs[name] = new ort.Tensor('int64', new BigInt64Array(n).fill(1n), [1, n]);
    else if (name === 'position_ids') inputs[name] = new ort.Tensor('int64', BigInt64Array.from(ids, (_, i) => BigInt(i)), [1, n]);
    else {
      const { dtype, data, shape } = session.checkpointState.tensor(name);
      inputs[name] = new ort.Tensor(dtype, data, shape);
    }
  }
  const out = await generator.run(inputs);
  const logits = out[generator.outputNames[0]];
  const vocab = logits.dims.at(-1);
  return logits.data.subarray((n - 1) * vocab, n * vocab);
}

/** The checkpoint without the frozen base: the adapters, their optimizer states and the step,
 * as `graphforge export PROGRAM --checkpoint FILE` reads a training run's. */
function adapterBytes() {
  const state = session.checkpointState;
  state.scheduler = schedule?.stateDict() ?? state.scheduler;
  const trained = (name) => state.roles[name] !== 'frozen';
  const roles = Object.fromEntries(Object.entries(state.roles).filter(([name]) => trained(name)));
  return new CheckpointState({ ...state, roles, tensors: new Map([...state.tensors].filter(([name]) => trained(name))) }).toBytes();
}

function download() {
  offer(adapterBytes(), `web-lm-step${session.checkpointState.step}.ckpt`);
}

// ------------------------------------------------------------------ the chart

function draw() {
  const { g, x, pad, top, bottom, label } = chartFrame($('chart'), {
    left: ['training loss', '#1f6feb'],
    right: ['held-out loss', '#e36209'],
    caption: `step ${log.step} of ${log.totalSteps}`,
    total: log.totalSteps,
  });
  const all = [...log.losses, ...log.heldOut.map((h) => h.loss)];
  if (all.length === 0) return;
  const most = Math.max(...all) * 1.05;
  const least = Math.min(...all) * 0.95;
  label(most.toFixed(2), pad - 4, top + 10, '#555', 'right');
  label(least.toFixed(2), pad - 4, bottom, '#555', 'right');
  const y = (loss) => top + ((bottom - top) * (most - loss)) / Math.max(1e-9, most - least);
  lossLine(g, x, y, log.losses, '#1f6feb');
  g.fillStyle = '#e36209';
  for (const { step, loss } of log.heldOut) {
    g.beginPath();
    g.arc(x(step), y(loss), 4, 0, 2 * Math.PI);
    g.fill();
  }
}

start().catch(fail);
