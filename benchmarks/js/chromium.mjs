// Run one side of benchmarks/ondevice_bench.py in a fresh headless Chromium (the system's,
// through puppeteer-core): one argument, {chromium, profile, url, timeoutMs}. Prints one
// JSON line: the page's window.result and the largest renderer's peak resident memory.
import { readFileSync, readdirSync } from 'node:fs';
import { createRequire } from 'node:module';

const puppeteer = createRequire(new URL('../../js/package.json', import.meta.url))('puppeteer-core');
const job = JSON.parse(process.argv[2]);

/** Peak resident memory (MiB) of each process below ``root``, by its command line. */
function peaks(root) {
  const children = new Map();
  for (const pid of readdirSync('/proc').filter((name) => /^\d+$/.test(name))) {
    try {
      const parent = Number(readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1].split(' ')[1]);
      children.set(parent, [...(children.get(parent) ?? []), Number(pid)]);
    } catch {
      // gone meanwhile
    }
  }
  const out = [];
  const walk = (pid) => {
    for (const child of children.get(pid) ?? []) {
      try {
        const status = readFileSync(`/proc/${child}/status`, 'utf8');
        const hwm = /VmHWM:\s+(\d+)/.exec(status);
        out.push({ cmdline: readFileSync(`/proc/${child}/cmdline`, 'utf8'), mib: hwm ? Number(hwm[1]) / 1024 : 0 });
      } catch {
        // gone meanwhile
      }
      walk(child);
    }
  };
  walk(root);
  return out;
}

const browser = await puppeteer.launch({
  executablePath: job.chromium,
  headless: true,
  protocolTimeout: job.timeoutMs,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
    '--disable-component-update', '--disable-sync', `--user-data-dir=${job.profile}`],
});
let out;
try {
  const page = await browser.newPage();
  await page.goto(job.url);
  await page.waitForFunction('window.result !== null && window.result !== undefined', { timeout: job.timeoutMs, polling: 200 });
  out = await page.evaluate(() => window.result);
  const renderers = peaks(browser.process().pid).filter((p) => p.cmdline.includes('--type=renderer'));
  out.peakMiB = Math.max(0, ...renderers.map((p) => p.mib));
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
