/** One error type for what graphforge's runtime refuses: its message names the file and the tensor. */
export class OndeviceError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'OndeviceError';
  }
}
