// The fixtures graphforge's Python side makes for these tests (tests/ondevice/js_fixtures.py):
// artifact folders, and values Python computed. `npm test` makes them first and names their
// folder in GRAPHFORGE_JS_FIXTURES; run alone (node --test), the tests that need them skip, saying so.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

export const folder = process.env.GRAPHFORGE_JS_FIXTURES;
export const skip = folder ? false : 'no fixtures: run npm test (it makes them with graphforge in Python)';
export const values = folder ? JSON.parse(readFileSync(join(folder, 'values.json'), 'utf8')) : {};
/** @param {string[]} parts */
export const at = (...parts) => join(/** @type {string} */ (folder), ...parts);
