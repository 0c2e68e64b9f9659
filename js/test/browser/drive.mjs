// Drive headless Chromium (the system's, through puppeteer-core) for the Python tests
// (tests/ondevice/test_browser.py). One argument, a JSON job:
//   {chromium, profile, harness: {name: url}, page: url, screenshot, timeoutMs}
// Prints one JSON line: each harness run's window.result, the page's window.graphforge after
// training, and after a reload (resumed from IndexedDB); the console's errors, and every
// request that failed or was answered with an error status (a missing favicon's 404).
import { launch, watchedPage } from './chromium.mjs';

const job = JSON.parse(process.argv[2]);
const timeout = job.timeoutMs ?? 180_000;
const browser = await launch(job);
const out = { harness: {}, console: [], failed: [] };
try {
  const page = await watchedPage(browser, out);
  for (const [name, url] of Object.entries(job.harness ?? {})) {
    await page.goto(url);
    await page.waitForFunction('window.result !== null && window.result !== undefined', { timeout });
    out.harness[name] = await page.evaluate(() => window.result);
  }
  if (job.page) {
    await page.setViewport({ width: 800, height: 640 });
    await page.goto(`${job.page}?autostart=1&fresh=1${job.query ?? ''}`);
    await page.waitForFunction('window.graphforge && (window.graphforge.done || window.graphforge.error)', { timeout });
    out.trained = await page.evaluate(() => ({ ...window.graphforge, losses: window.graphforge.losses.length }));
    out.status = await page.$eval('#status', (element) => element.textContent);
    if (job.screenshot) await page.screenshot({ path: job.screenshot });
    await page.goto(job.page);
    await page.waitForFunction('window.graphforge && (window.graphforge.resumedAt !== null || window.graphforge.error)', { timeout });
    out.reloaded = await page.evaluate(() => ({ resumedAt: window.graphforge.resumedAt, accuracy: window.graphforge.accuracy, error: window.graphforge.error }));
    out.reloadedStatus = await page.$eval('#status', (element) => element.textContent);
  }
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
