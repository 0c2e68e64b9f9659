// The manifest of an artifact folder (graphforge/ondevice/manifest.py writes it): each
// model's file, sha256, inputs and outputs with their roles, the carried tensors, the
// optimizer and the checkpoint. A newer schema version, or a file whose sha256 differs, is refused.
import { OndeviceError } from './errors.js';
import { readBytes, sha256Hex } from './files.js';

export const FORMAT = 'graphforge.ondevice';
/** 2: the models may include train_steps (k steps in one run); version-1 folders read as before */
export const VERSION = 2;

/** @typedef {import('../types/index.js').Manifest} Manifest */

/** The manifest at ``source`` (a path, URL, or bytes), checked against its schema.
 * @param {import('../types/index.js').Source} source
 * @param {string} where
 * @returns {Promise<Manifest>} */
export async function readManifest(source, where) {
  const bytes = await readBytes(source);
  let document;
  try {
    document = JSON.parse(new TextDecoder().decode(bytes));
  } catch (error) {
    throw new OndeviceError(`${where}: cannot read it as JSON (${/** @type {Error} */ (error).message})`);
  }
  return checkManifest(document, where);
}

/** ``document`` as a manifest, once it is one this runtime reads.
 * @param {any} document
 * @param {string} [where]
 * @returns {Manifest} */
export function checkManifest(document, where = 'manifest.json') {
  if (!document || document.format !== FORMAT) throw new OndeviceError(`${where}: not a graphforge artifact manifest (its format is not '${FORMAT}')`);
  if (!Number.isInteger(document.version) || document.version > VERSION) {
    throw new OndeviceError(`${where}: manifest version ${document.version} is newer than this runtime reads (${VERSION}): upgrade @graphforge/ondevice, or write the artifacts with a graphforge of its version`);
  }
  for (const key of ['models', 'state', 'checkpoint', 'loss']) {
    if (!(key in document)) throw new OndeviceError(`${where}: the manifest lacks '${key}'`);
  }
  if (!document.models.training || !document.models.optimizer) {
    throw new OndeviceError(`${where}: the manifest names no training and optimizer models`);
  }
  return document;
}

/** Refuse ``bytes`` (the file ``name``) unless its sha256 is the manifest's ``expected``.
 * @param {Uint8Array} bytes
 * @param {string} expected
 * @param {string} name */
export async function checkHash(bytes, expected, name) {
  const got = await sha256Hex(bytes);
  if (got !== expected) {
    throw new OndeviceError(`${name}: its sha256 is ${got.slice(0, 16)}…, the manifest's ${expected.slice(0, 16)}… (a file changed since it was written, or another set's)`);
  }
}
