// The element types a checkpoint and a manifest name (numpy's names), safetensors' codes for
// them, the typed array that holds each, and onnxruntime-web/-node's tensor type.
/**
 * @typedef {import('../types/index.js').DType} DType
 * @typedef {import('../types/index.js').TypedArray} TypedArray
 * @typedef {{code: string, array: {new (buffer: ArrayBufferLike, offset: number, length: number): TypedArray, BYTES_PER_ELEMENT: number}, ort: string}} TypeInfo
 */
/** @type {Record<DType, TypeInfo>} */
const TYPES = {
  float32: { code: 'F32', array: Float32Array, ort: 'float32' },
  float64: { code: 'F64', array: Float64Array, ort: 'float64' },
  float16: { code: 'F16', array: Uint16Array, ort: 'float16' },
  int64: { code: 'I64', array: BigInt64Array, ort: 'int64' },
  int32: { code: 'I32', array: Int32Array, ort: 'int32' },
  int16: { code: 'I16', array: Int16Array, ort: 'int16' },
  int8: { code: 'I8', array: Int8Array, ort: 'int8' },
  uint64: { code: 'U64', array: BigUint64Array, ort: 'uint64' },
  uint32: { code: 'U32', array: Uint32Array, ort: 'uint32' },
  uint16: { code: 'U16', array: Uint16Array, ort: 'uint16' },
  uint8: { code: 'U8', array: Uint8Array, ort: 'uint8' },
  bool: { code: 'BOOL', array: Uint8Array, ort: 'bool' },
};
const NAMES = /** @type {[DType, TypeInfo][]} */ (Object.entries(TYPES));
/** @type {Record<string, DType>} */
const BY_CODE = Object.fromEntries(NAMES.map(([name, t]) => [t.code, name]));
/** @type {Record<string, DType>} */
const BY_ORT = Object.fromEntries(NAMES.map(([name, t]) => [t.ort, name]));

/** @param {DType} name */
export function dtypeInfo(name) {
  return TYPES[name];
}

/** numpy's name of safetensors' code (F32 -> float32), or undefined.
 * @param {string} code
 * @returns {DType | undefined} */
export function dtypeOfCode(code) {
  return BY_CODE[code];
}

/** numpy's name of an onnxruntime tensor type (float32 -> float32, bool -> bool), or undefined.
 * @param {string} type
 * @returns {DType | undefined} */
export function dtypeOfOrt(type) {
  return BY_ORT[type];
}

/** A typed array of ``name``'s elements viewing ``bytes`` (a Uint8Array), copied where its offset is not aligned.
 * @param {DType} name
 * @param {Uint8Array} bytes
 * @returns {TypedArray} */
export function viewAs(name, bytes) {
  const Array = TYPES[name].array;
  const size = Array.BYTES_PER_ELEMENT;
  if (bytes.byteOffset % size !== 0) bytes = bytes.slice();
  return new Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / size);
}

/** The bytes of a typed array (a view, no copy).
 * @param {TypedArray} data */
export function bytesOf(data) {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

/** @param {number[]} shape */
export function elementCount(shape) {
  return shape.reduce((a, b) => a * b, 1);
}
