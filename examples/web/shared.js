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
