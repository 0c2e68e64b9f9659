// graphforge's checkpoint, read and written without a library: a safetensors file (an 8-byte
// little-endian header length, a JSON header giving each tensor's dtype, shape and byte range,
// the bytes) whose header metadata holds, under "graphforge.checkpoint", one JSON document:
// the step, the learning rate, the schedule's state, seeds, user properties, and each tensor's
// name, role, dtype, shape and CRC-32 (graphforge/runtime/checkpoint.py writes the same).
import { crc32 } from './crc32.js';
import { bytesOf, dtypeInfo, dtypeOfCode, elementCount, viewAs } from './dtypes.js';
import { OndeviceError } from './errors.js';
import { readBytes, writeAtomically } from './files.js';

export const FORMAT = 'graphforge.checkpoint';
export const VERSION = 1;
const METADATA_KEY = 'graphforge.checkpoint';
const MAX_HEADER = 100_000_000;

/**
 * @typedef {import('../types/index.js').StoredTensor} StoredTensor
 * @typedef {import('../types/index.js').ScheduleState} ScheduleState
 * @typedef {import('../types/index.js').Source} Source
 * @typedef {{dtype: string, shape: number[], data_offsets: [number, number]}} HeaderEntry
 * @typedef {{__metadata__?: Record<string, string>} & Record<string, HeaderEntry>} Header
 */

/** The state of a training session: every carried tensor (name -> {dtype, shape, data}) and
 * what resuming needs besides (step, learning rate, schedule, seeds, properties). */
export class CheckpointState {
  /**
   * @param {{tensors: Map<string, StoredTensor>, roles?: Record<string, string>, step?: number, learningRate?: number | null,
   *   scheduler?: ScheduleState | null, seeds?: Record<string, number>, dataPosition?: unknown, properties?: Record<string, unknown>,
   *   gradResetPending?: boolean, microBatch?: number}} init
   */
  constructor({
    tensors,
    roles = {},
    step = 0,
    learningRate = null,
    scheduler = null,
    seeds = {},
    dataPosition = null,
    properties = {},
    gradResetPending = true,
    microBatch = 0,
  }) {
    this.tensors = tensors;
    this.roles = roles;
    this.step = step;
    this.learningRate = learningRate;
    this.scheduler = scheduler;
    this.seeds = seeds;
    this.dataPosition = dataPosition;
    this.properties = properties;
    this.gradResetPending = gradResetPending;
    this.microBatch = microBatch;
  }

  /** A checkpoint from its bytes; ``where`` names it in errors.
   * @param {Uint8Array | ArrayBuffer} source
   * @param {string} [where] */
  static fromBytes(source, where = 'checkpoint') {
    const bytes = source instanceof Uint8Array ? source : new Uint8Array(source);
    const { header, dataStart } = readHeader(bytes, where);
    const metadata = header.__metadata__ || {};
    if (!(METADATA_KEY in metadata)) {
      throw new OndeviceError(`${where}: not a graphforge checkpoint (no "${METADATA_KEY}" metadata)`);
    }
    const document = parseDocument(metadata[METADATA_KEY], where);
    if (document.shards || document.tensors.some((/** @type {{part?: unknown}} */ t) => t.part)) {
      throw new OndeviceError(`${where}: a sharded checkpoint (its tensors in several files): load it whole with graphforge in Python, and save it again`);
    }
    /** @type {Map<string, StoredTensor>} */
    const tensors = new Map();
    /** @type {Record<string, string>} */
    const roles = {};
    for (const spec of document.tensors) {
      const entry = header[spec.name];
      if (!entry) throw new OndeviceError(`${where}: tensor '${spec.name}' is in its manifest but not in the file`);
      const dtype = dtypeOfCode(entry.dtype);
      if (!dtype || dtype !== spec.dtype || !sameShape(entry.shape, spec.shape)) {
        throw new OndeviceError(`${where}: tensor '${spec.name}' is ${dtype ?? entry.dtype} [${entry.shape}] but its manifest says ${spec.dtype} [${spec.shape}]`);
      }
      const [start, stop] = entry.data_offsets;
      const raw = bytes.subarray(dataStart + start, dataStart + stop);
      if (raw.byteLength !== elementCount(spec.shape) * dtypeInfo(dtype).array.BYTES_PER_ELEMENT) {
        throw new OndeviceError(`${where}: tensor '${spec.name}' holds ${raw.byteLength} bytes, not what [${spec.shape}] of ${dtype} needs`);
      }
      if (spec.crc32 !== undefined && crc32(raw) !== spec.crc32) {
        throw new OndeviceError(`${where}: tensor '${spec.name}' is damaged: its bytes do not match the checksum saved with it (crc32 ${hex(crc32(raw))}, saved ${hex(spec.crc32)})`);
      }
      tensors.set(spec.name, { dtype, shape: spec.shape.slice(), data: viewAs(dtype, raw) });
      roles[spec.name] = spec.role;
    }
    const extra = Object.keys(header).filter((n) => n !== '__metadata__' && !tensors.has(n));
    if (extra.length) throw new OndeviceError(`${where}: tensor '${extra[0]}' is in the file but not in its manifest`);
    return new CheckpointState({
      tensors,
      roles,
      step: document.step,
      learningRate: document.learning_rate ?? null,
      scheduler: document.scheduler ?? null,
      seeds: document.seeds ?? {},
      dataPosition: document.data_position ?? null,
      properties: document.properties ?? {},
      gradResetPending: document.grad_reset_pending ?? true,
      microBatch: document.micro_batch ?? 0,
    });
  }

  /** A checkpoint from a file path (Node), a URL (fetched), or bytes.
   * @param {Source} source
   * @param {string} [where] */
  static async load(source, where) {
    return CheckpointState.fromBytes(await readBytes(source), where ?? describe(source));
  }

  /** The checkpoint's bytes: what graphforge in Python loads (CheckpointState.load).
   * @returns {Uint8Array} */
  toBytes() {
    const held = [...this.tensors.entries()];
    const entries = held.map(([name, t]) => ({ name, ...t, bytes: bytesOf(t.data) }));
    // largest elements first, so that every tensor starts aligned to its element size
    entries.sort((a, b) => dtypeInfo(b.dtype).array.BYTES_PER_ELEMENT - dtypeInfo(a.dtype).array.BYTES_PER_ELEMENT);
    const document = {
      format: FORMAT,
      version: VERSION,
      step: this.step,
      learning_rate: this.learningRate,
      scheduler: this.scheduler,
      seeds: this.seeds,
      data_position: this.dataPosition,
      properties: this.properties,
      grad_reset_pending: Boolean(this.gradResetPending),
      micro_batch: this.microBatch,
      tensors: held.map(([name, t]) => ({ name, role: this.roles[name] ?? 'unknown', dtype: t.dtype, shape: t.shape, crc32: crc32(bytesOf(t.data)) })),
    };
    /** @type {Record<string, unknown>} */
    const header = { __metadata__: { [METADATA_KEY]: JSON.stringify(document) } };
    let offset = 0;
    for (const e of entries) {
      header[e.name] = { dtype: dtypeInfo(e.dtype).code, shape: e.shape, data_offsets: [offset, offset + e.bytes.byteLength] };
      offset += e.bytes.byteLength;
    }
    const text = new TextEncoder().encode(JSON.stringify(header));
    const padded = Math.ceil(text.byteLength / 8) * 8;
    const out = new Uint8Array(8 + padded + offset);
    new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
    out.fill(0x20, 8, 8 + padded); // the header padded with spaces, as safetensors pads it
    out.set(text, 8);
    let at = 8 + padded;
    for (const e of entries) {
      out.set(e.bytes, at);
      at += e.bytes.byteLength;
    }
    return out;
  }

  /** Write the checkpoint to ``path`` at once (Node): a reader sees the old file or the new one.
   * @param {string} path */
  async save(path) {
    await writeAtomically(path, this.toBytes());
    return path;
  }

  /** The tensor ``name``, or an error naming it.
   * @param {string} name
   * @returns {StoredTensor} */
  tensor(name) {
    const t = this.tensors.get(name);
    if (!t) throw new OndeviceError(`the checkpoint has no tensor '${name}'`);
    return t;
  }
}

/** @param {Uint8Array} bytes @param {string} where @returns {{header: Header, dataStart: number}} */
function readHeader(bytes, where) {
  if (bytes.byteLength < 8) throw new OndeviceError(`${where}: not a checkpoint (${bytes.byteLength} bytes: cut short before its header)`);
  const length = Number(new DataView(bytes.buffer, bytes.byteOffset, 8).getBigUint64(0, true));
  if (length > MAX_HEADER) throw new OndeviceError(`${where}: not a checkpoint (not a safetensors file: no header length)`);
  if (length > bytes.byteLength - 8) {
    throw new OndeviceError(`${where}: truncated inside its header (${length} bytes, the file holds ${bytes.byteLength - 8} after its length)`);
  }
  /** @type {Header} */
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + length)));
  } catch {
    throw new OndeviceError(`${where}: damaged: its safetensors header is not valid JSON`);
  }
  const dataStart = 8 + length;
  const available = bytes.byteLength - dataStart;
  const ranges = Object.entries(header)
    .filter(([name]) => name !== '__metadata__')
    .map(([name, e]) => /** @type {[number, number, string]} */ ([e.data_offsets[0], e.data_offsets[1], name]))
    .sort((a, b) => a[0] - b[0]);
  const cut = ranges.filter(([, stop]) => stop > available);
  if (cut.length) {
    const [start, stop, name] = cut[0];
    const more = cut.length > 1 ? `; ${cut.length - 1} more tensor(s) after it are cut or missing` : '';
    throw new OndeviceError(`${where}: truncated: tensor '${name}' needs data bytes ${start}..${stop} but the file holds only ${available}${more}`);
  }
  return { header, dataStart };
}

/** @param {string} text @param {string} where @returns {any} */
function parseDocument(text, where) {
  let document;
  try {
    document = JSON.parse(text);
  } catch (error) {
    throw new OndeviceError(`${where}: its properties are not valid JSON (${/** @type {Error} */ (error).message})`);
  }
  if (!document || document.format !== FORMAT) throw new OndeviceError(`${where}: its properties are not a ${FORMAT} document`);
  if (document.version !== VERSION) {
    throw new OndeviceError(`${where}: checkpoint format version ${document.version}; this runtime reads version ${VERSION}`);
  }
  if (!Number.isInteger(document.step) || document.step < 0) throw new OndeviceError(`${where}: its step is ${document.step}, expected a whole number ≥ 0`);
  if (!Array.isArray(document.tensors)) throw new OndeviceError(`${where}: its properties have no tensor manifest`);
  return document;
}

/** @param {number[]} a @param {number[]} b */
function sameShape(a, b) {
  return a.length === b.length && a.every((d, i) => d === b[i]);
}

/** @param {number} n */
function hex(n) {
  return n.toString(16).padStart(8, '0');
}

/** @param {Source} source */
function describe(source) {
  return typeof source === 'string' ? source : source instanceof URL ? source.href : 'checkpoint';
}
