// Reading and writing bytes the same way on Node and in a browser: a Uint8Array or
// ArrayBuffer as it is, a URL (or an http(s) or relative URL string in a browser) fetched,
// any other string a path on disk (Node, read with node:fs). node: modules are imported only
// where Node runs, and marked so that a bundler for the browser leaves them out.
import { OndeviceError } from './errors.js';

const inNode = typeof process !== 'undefined' && Boolean(process.versions?.node);

/** @typedef {import('../types/index.js').Source} Source */

/** The bytes of ``source``: a Uint8Array, an ArrayBuffer, a URL, or a path (Node).
 * @param {Source} source
 * @returns {Promise<Uint8Array>} */
export async function readBytes(source) {
  if (source instanceof Uint8Array) return source;
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  const url = fetched(source);
  if (url) {
    if (url.protocol === 'file:' && inNode) return readFile(url);
    const response = await fetch(url);
    if (!response.ok) throw new OndeviceError(`${url.href}: cannot fetch it (${response.status} ${response.statusText})`);
    return new Uint8Array(await response.arrayBuffer());
  }
  if (typeof source === 'string') return readFile(source);
  throw new OndeviceError(`cannot read ${String(source)}: give a path, a URL, a Uint8Array or an ArrayBuffer`);
}

/** Why ``source`` cannot be read ('no such file', 'cannot fetch it (404 Not Found)'), without
 * reading it: null where it is there (bytes are always there).
 * @param {Source} source
 * @returns {Promise<string | null>} */
export async function missing(source) {
  if (source instanceof Uint8Array || source instanceof ArrayBuffer) return null;
  const url = fetched(source);
  if (url && !(url.protocol === 'file:' && inNode)) {
    // only "not there" refuses now: a server that answers HEAD otherwise (405, or 403 for a URL
    // signed for GET) leaves the file to its first read, which says what went wrong
    const response = await fetch(url, { method: 'HEAD' });
    return response.status === 404 || response.status === 410 ? `cannot fetch it (${response.status} ${response.statusText})` : null;
  }
  const fs = await import(/* webpackIgnore: true */ /* @vite-ignore */ 'node:fs/promises');
  try {
    return (await fs.stat(url ?? String(source))).isFile() ? null : 'not a file';
  } catch (error) {
    return problem(error);
  }
}

/** The URL ``source`` is fetched from, or null for a path on disk (Node).
 * @param {Source} source */
function fetched(source) {
  if (source instanceof URL) return source;
  if (typeof source === 'string' && (!inNode || /^https?:/.test(source))) return new URL(source, globalThis.location?.href);
  return null;
}

/** @param {string | URL} path */
async function readFile(path) {
  const fs = await import(/* webpackIgnore: true */ /* @vite-ignore */ 'node:fs/promises');
  try {
    return new Uint8Array(await fs.readFile(path));
  } catch (error) {
    throw new OndeviceError(`${path}: ${problem(error)}`);
  }
}

/** @param {unknown} error */
function problem(error) {
  const { code, message } = /** @type {{code?: string, message: string}} */ (error);
  return code === 'ENOENT' ? 'no such file' : message;
}

/** Replace the file at ``path`` with ``bytes`` at once (Node): written beside it, then renamed.
 * @param {string} path
 * @param {Uint8Array} bytes */
export async function writeAtomically(path, bytes) {
  if (!inNode) throw new OndeviceError('writing a file needs Node; in a browser, keep the bytes (toBytes()) instead');
  const fs = await import(/* webpackIgnore: true */ /* @vite-ignore */ 'node:fs/promises');
  const { dirname, basename, join } = await import(/* webpackIgnore: true */ /* @vite-ignore */ 'node:path');
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
    throw new OndeviceError(`${path}: cannot write it (${problem(error)})`);
  }
}

/** The sha256 of ``bytes`` as lowercase hex (WebCrypto: Node 20 and browsers).
 * @param {Uint8Array} bytes */
export async function sha256Hex(bytes) {
  const digest = new Uint8Array(await globalThis.crypto.subtle.digest('SHA-256', /** @type {Uint8Array<ArrayBuffer>} */ (bytes)));
  return [...digest].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** ``name`` resolved against ``base`` (a folder path, or a URL of one).
 * @param {string | URL} base
 * @param {string} name
 * @returns {string | URL} */
export function resolveBeside(base, name) {
  if (base instanceof URL) return new URL(name, base.href.endsWith('/') ? base : `${base.href}/`);
  if (typeof base === 'string' && (!inNode || /^https?:/.test(base))) {
    return new URL(name, new URL(base.endsWith('/') ? base : `${base}/`, globalThis.location?.href));
  }
  return base.endsWith('/') ? `${base}${name}` : `${base}/${name}`;
}

export { inNode };
