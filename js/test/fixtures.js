// The fixtures graphforge's Python side makes for these tests (tests/ondevice/test_js_runtime.py
// runs them with GRAPHFORGE_JS_FIXTURES set): artifact folders, and values Python computed.
// Run alone (npm test), the tests that need them are skipped, saying so.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

export const folder = process.env.GRAPHFORGE_JS_FIXTURES;
export const skip = folder ? false : 'no fixtures: run through pytest (tests/ondevice/test_js_runtime.py)';
export const values = folder ? JSON.parse(readFileSync(join(folder, 'values.json'), 'utf8')) : {};
export const at = (...parts) => join(folder, ...parts);
