// npm test: the unit tests (node --test test/*.test.js) with the fixtures graphforge in Python
// makes for them (tests/ondevice/js_fixtures.py), written into a temporary folder first.
// GRAPHFORGE_JS_FIXTURES names a folder made already (tests/ondevice/test_js_runtime.py sets it);
// PYTHON, a Python with graphforge (default: the repository's .venv, which make install makes).
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const JS = fileURLToPath(new URL('..', import.meta.url));
const REPO = join(JS, '..');

/** Stop with one line saying what is missing and how to get it.
 * @param {string} what @param {string} how what make install does that gives it */
function missing(what, how) {
  console.error(`${what} is missing: run make install first (${how})`);
  process.exit(2);
}

try {
  createRequire(import.meta.url).resolve('onnxruntime-node');
} catch {
  missing('onnxruntime-node', 'it runs npm ci in js/');
}

let fixtures = process.env.GRAPHFORGE_JS_FIXTURES;
let made = null;
if (!fixtures) {
  const python = process.env.PYTHON ?? join(REPO, '.venv', 'bin', 'python');
  if (!existsSync(python)) missing(`${python} (the Python whose graphforge makes the tests' fixtures)`, 'it makes .venv; or set PYTHON to another');
  made = fixtures = mkdtempSync(join(tmpdir(), 'graphforge-js-fixtures-'));
  console.log(`making the fixtures with ${python} (tests/ondevice/js_fixtures.py) in ${fixtures}`);
  const done = spawnSync(python, [join(REPO, 'tests', 'ondevice', 'js_fixtures.py'), fixtures], { stdio: 'inherit' });
  if (done.status !== 0) {
    rmSync(made, { recursive: true, force: true });
    console.error(`npm test: tests/ondevice/js_fixtures.py failed (exit ${done.status ?? done.signal}): the fixtures could not be made`);
    process.exit(1);
  }
}
const files = readdirSync(join(JS, 'test')).filter((f) => f.endsWith('.test.js')).sort().map((f) => join('test', f));
const run = spawnSync(process.execPath, ['--test', ...files], { cwd: JS, stdio: 'inherit', env: { ...process.env, GRAPHFORGE_JS_FIXTURES: fixtures } });
if (made) rmSync(made, { recursive: true, force: true });
process.exit(run.status ?? 1);
