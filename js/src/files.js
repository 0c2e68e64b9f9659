// Reading and writing bytes the same way on Node and in a browser: a Uint8Array or
// ArrayBuffer as it is, a URL (or an http(s) or relative URL string in a browser) fetched,
// any other string a path on disk (Node, read with node:fs).
import { OndeviceError } from './errors.js';

const inNode = typeof process !== 'undefined' && Boolean(process.versions?.node);

/** The bytes of ``source``: a Uint8Array, an ArrayBuffer, a URL, or a path (Node). */
export async function readBytes(source) {
  if (source instanceof Uint8Array) return source;
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  if (source instanceof URL || (typeof source === 'string' && (!inNode || /^https?:/.test(source)))) {
    const url = source instanceof URL ? source : new URL(source, globalThis.location?.href);
    if (url.protocol === 'file:' && inNode) return readFile(url);
    const response = await fetch(url);
    if (!response.ok) throw new OndeviceError(`${url.href}: cannot fetch it (${response.status} ${response.statusText})`);
    return new Uint8Array(await response.arrayBuffer());
  }
  if (typeof source === 'string') return readFile(source);
  throw new OndeviceError(`cannot read ${String(source)}: give a path, a URL, a Uint8Array or an ArrayBuffer`);
}

async function readFile(path) {
  const fs = await import('node:fs/promises');
  try {
    return new Uint8Array(await fs.readFile(path));
  } catch (error) {
    throw new OndeviceError(`${path}: ${error.code === 'ENOENT' ? 'no such file' : error.message}`);
  }
}

/** Replace the file at ``path`` with ``bytes`` at once (Node): written beside it, then renamed. */
export async function writeAtomically(path, bytes) {
  if (!inNode) throw new OndeviceError('writing a file needs Node; in a browser, keep the bytes (toBytes()) instead');
  const fs = await import('node:fs/promises');
  const { dirname, basename, join } = await import('node:path');
  const temporary = join(dirname(path), `.${basename(path)}.${process.pid}.${Date.now()}.tmp`);
  const handle = await fs.open(temporary, 'w', 0o666);
  try {
    await handle.writeFile(bytes);
    await handle.sync();
  } finally {
    await handle.close();
  }
  try {
    await fs.rename(temporary, path);
  } catch (error) {
    await fs.rm(temporary, { force: true });
    throw new OndeviceError(`${path}: cannot write it (${error.message})`);
  }
}

/** The sha256 of ``bytes`` as lowercase hex (WebCrypto: Node 20 and browsers). */
export async function sha256Hex(bytes) {
  const digest = new Uint8Array(await globalThis.crypto.subtle.digest('SHA-256', bytes));
  return [...digest].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** ``name`` resolved against ``base`` (a folder path, or a URL of one). */
export function resolveBeside(base, name) {
  if (base instanceof URL) return new URL(name, base.href.endsWith('/') ? base : `${base.href}/`);
  if (typeof base === 'string' && (!inNode || /^https?:/.test(base))) {
    return new URL(name, new URL(base.endsWith('/') ? base : `${base}/`, globalThis.location?.href));
  }
  return base.endsWith('/') ? `${base}${name}` : `${base}/${name}`;
}

export { inNode };
