// What a page keeps between visits: one record, under 'latest', in an IndexedDB object store.
// Both pages (examples/web/, examples/web-lm/) keep their training this way.

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
