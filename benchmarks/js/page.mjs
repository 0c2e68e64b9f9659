// The browser's entry of benchmarks/ondevice_bench.py: the job names its side; the libraries
// load from node_modules as a page would load them, and the result (sides.mjs's, with what
// the page downloaded) is left in window.result for the driver (chromium.mjs).
import { measure } from './sides.mjs';

const TFJS = '/benchmarks/js/node_modules/@tensorflow/';

function script(src) {
  return new Promise((resolve, reject) => {
    const element = document.createElement('script');
    element.src = src;
    element.onload = resolve;
    element.onerror = () => reject(new Error(`could not load ${src}`));
    document.head.append(element);
  });
}

window.result = null;
try {
  const job = await (await fetch(new URLSearchParams(location.search).get('job'))).json();
  const load = async (url) => (await fetch(url)).arrayBuffer();
  const libraries = { load };
  if (job.side === 'tfjs') {
    await script(`${TFJS}tfjs/dist/tf.min.js`);
    libraries.tf = window.tf;
    if (job.backend === 'wasm') {
      await script(`${TFJS}tfjs-backend-wasm/dist/tf-backend-wasm.min.js`);
      libraries.tfWasm = window.tf.wasm;
      libraries.wasmPaths = `${TFJS}tfjs-backend-wasm/dist/`;
    }
  } else {
    const ort = await import('/js/node_modules/onnxruntime-web/dist/ort.wasm.bundle.min.mjs');
    ort.env.wasm.wasmPaths = '/js/node_modules/onnxruntime-web/dist/';
    libraries.ort = ort;
  }
  const result = await measure(job, libraries);
  // what the page downloaded of the libraries (not the model or the data)
  result.downloadedBytes = performance
    .getEntriesByType('resource')
    .filter((entry) => entry.name.includes('/node_modules/') || entry.name.includes('/js/src/') || entry.name.endsWith('sides.mjs'))
    .reduce((sum, entry) => sum + entry.encodedBodySize, 0);
  result.isolated = self.crossOriginIsolated;
  window.result = result;
} catch (error) {
  window.result = { error: String(error?.stack ?? error) };
}
