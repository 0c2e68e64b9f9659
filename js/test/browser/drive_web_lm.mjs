// Drive headless Chromium (the system's, through puppeteer-core) through the page that
// fine-tunes a language model (examples/web-lm/), for tests/ondevice/test_web_lm.py. One
// argument, a JSON job: {chromium, profile, page (its URL with the query), reload (the URL to
// reload with), downloads (a folder), screenshot (a .png of the chart), timeoutMs}. Prints one
// JSON line: the page's window.graphforge after training, the file its download button saved,
// the page's window.graphforge after a reload (restored from IndexedDB, then as its query says),
// the console's errors, every request that failed, and when each part ended (ms, `at`).
import fs from 'node:fs';
import path from 'node:path';
import { launch, watchedPage } from './chromium.mjs';

const job = JSON.parse(process.argv[2]);
const timeout = job.timeoutMs ?? 120_000;
const browser = await launch(job);
const out = { console: [], failed: [], at: {} };
const t0 = Date.now();
const mark = (what) => (out.at[what] = Date.now() - t0);
const settled = 'window.graphforge && (window.graphforge.settled || window.graphforge.error)';
try {
  const page = await watchedPage(browser, out);
  await page.setViewport({ width: 800, height: 900 });
  await page.goto(`${job.page}&autostart=1&fresh=1`);
  await page.waitForFunction(settled, { timeout });
  mark('trained');
  out.trained = await page.evaluate(() => window.graphforge);
  out.status = await page.$eval('#status', (element) => element.textContent);
  if (job.screenshot) await (await page.$('#chart')).screenshot({ path: job.screenshot });
  if (!out.trained.error) {
    const cdp = await page.createCDPSession();
    await cdp.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: job.downloads, eventsEnabled: true });
    const saved = new Promise((resolve) => cdp.on('Browser.downloadProgress', (e) => e.state === 'completed' && resolve(e)));
    const named = new Promise((resolve) => cdp.on('Browser.downloadWillBegin', (e) => resolve(e.suggestedFilename)));
    await page.click('#download');
    await saved;
    mark('downloaded');
    out.download = path.join(job.downloads, await named);
    if (!fs.existsSync(out.download)) throw new Error(`the download ${out.download} is not there`);
    await page.goto(job.reload);
    await page.waitForFunction(settled, { timeout });
    mark('reloaded');
    out.reloaded = await page.evaluate(() => window.graphforge);
  }
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
