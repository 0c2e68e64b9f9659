// What the two pages (examples/web/, examples/web-lm/) share: the record a page keeps between
// visits (one, under 'latest', in an IndexedDB object store), and a file offered for download.

/**
 * ``kept(action, value)`` over the store ``store`` of the database ``name``: 'get' resolves to
 * the record (undefined where there is none), 'put' keeps ``value``, 'delete' forgets it.
 * @param {string} name
 * @param {string} store
 */
export function keeper(name, store) {
  function database() {
    return new Promise((resolve, reject) => {
      const request = indexedDB.open(name, 1);
      request.onupgradeneeded = () => request.result.createObjectStore(store);
      request.onsuccess = () => resolve(request.result);
      request.onerror = () => reject(request.error);
    });
  }
  return async function kept(action, value) {
    const db = await database();
    return new Promise((resolve, reject) => {
      const records = db.transaction(store, action === 'get' ? 'readonly' : 'readwrite').objectStore(store);
      const request = action === 'get' ? records.get('latest') : action === 'put' ? records.put(value, 'latest') : records.delete('latest');
      request.onsuccess = () => resolve(request.result);
      request.onerror = () => reject(request.error);
    });
  };
}

/** Offer ``bytes`` as a download named ``name`` (the browser's save dialog or downloads folder). */
export function offer(bytes, name) {
  const url = URL.createObjectURL(new Blob([bytes], { type: 'application/octet-stream' }));
  const link = Object.assign(document.createElement('a'), { href: url, download: name });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/**
 * The frame of a page's chart on ``canvas``: a box, a legend at each top corner (``[text,
 * colour]``), ``caption`` below it. Returns the context, ``x(step)`` over ``total`` steps, the
 * box's top and bottom, and ``label``, which draws a text and records its box in ``labels``
 * (where the drawing put it, for whoever drives the page).
 */
export function chartFrame(canvas, { left, right, caption, total }) {
  const g = canvas.getContext('2d');
  const { width, height } = canvas;
  // the legends above the plot, the step below it: nothing drawn in the plot covers them
  const pad = 36;
  const top = 28;
  const bottom = height - pad;
  g.clearRect(0, 0, width, height);
  g.strokeStyle = '#bbb';
  g.strokeRect(pad, top, width - 2 * pad, bottom - top);
  g.font = '12px system-ui';
  const labels = [];
  const label = (text, x, y, color, align) => {
    g.fillStyle = color;
    g.textAlign = align;
    g.fillText(text, x, y);
    const m = g.measureText(text);
    const start = align === 'right' ? x - m.width : align === 'center' ? x - m.width / 2 : x;
    labels.push({ text, left: start, right: start + m.width, top: y - m.actualBoundingBoxAscent, bottom: y + m.actualBoundingBoxDescent });
  };
  label(left[0], pad, top - 10, left[1], 'left');
  label(right[0], width - pad, top - 10, right[1], 'right');
  label(caption, width / 2, height - 10, '#555', 'center');
  const x = (step) => pad + ((width - 2 * pad) * step) / Math.max(1, total);
  return { g, x, pad, top, bottom, label, labels };
}

/** A line through ``values`` (the first at step 1), in ``color``. */
export function lossLine(g, x, y, values, color) {
  g.strokeStyle = color;
  g.lineWidth = 1.5;
  g.beginPath();
  values.forEach((value, i) => (i ? g.lineTo(x(i + 1), y(value)) : g.moveTo(x(i + 1), y(value))));
  g.stroke();
}
