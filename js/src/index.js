// @graphforge/ondevice: train graphforge's on-device artifacts on stock onnxruntime, in Node.js
// (onnxruntime-node) and in the browser (onnxruntime-web), with the surface of the
// TrainingSession onnxruntime-web removed in 1.20. The same code runs on both: give
// TrainingSession.create the onnxruntime namespace to run on.
export { CheckpointState } from './checkpoint.js';
export { crc32 } from './crc32.js';
export { runKey } from './dropout.js';
export { OndeviceError } from './errors.js';
export { checkManifest, readManifest } from './manifest.js';
export { ConstantSchedule, CosineSchedule, LinearSchedule, PolynomialSchedule, makeSchedule, scheduleFromState } from './schedules.js';
export { TrainingSession } from './session.js';
