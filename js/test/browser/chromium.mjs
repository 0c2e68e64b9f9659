// What the drivers of the browser tests share: headless Chromium (the system's, through
// puppeteer-core) in a profile of the job's, and a page that records its console's errors and
// every request that failed or was answered with an error status.
import puppeteer from 'puppeteer-core';

/** @param {{chromium: string, profile: string}} job */
export function launch(job) {
  return puppeteer.launch({
    executablePath: job.chromium,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync', `--user-data-dir=${job.profile}`],
  });
}

/** A new page of ``browser`` whose errors go to ``out.console`` and failed requests to ``out.failed``. */
export async function watchedPage(browser, out) {
  const page = await browser.newPage();
  page.on('console', (message) => message.type() === 'error' && out.console.push(message.text()));
  page.on('pageerror', (error) => out.console.push(String(error)));
  page.on('response', (response) => response.status() >= 400 && out.failed.push(`${response.status()} ${response.url()}`));
  // (a HEAD request, answered, ends as 'aborted': Chromium drops the body it announces; its status counts)
  page.on('requestfailed', (request) => !request.response() && out.failed.push(`${request.failure()?.errorText} ${request.url()}`));
  return page;
}
