// Train the digits MLP on graphforge's artifacts with onnxruntime-node, as the README shows.
// From the repository's root, after make install:
//   .venv/bin/graphforge artifacts examples/digits/model.onnx -o out/artifacts \
//       -p "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01)"
//   node js/examples/train.mjs out/artifacts
import { TrainingSession, makeSchedule } from '@graphforge/ondevice';
import { accuracy, digits, missing } from './digits.mjs';

const ort = await import('onnxruntime-node').catch(() => missing('onnxruntime-node')); // in a browser: 'onnxruntime-web'
const folder = process.argv[2] ?? 'out/artifacts';
const { batches, test } = digits(ort, { batch: 32, epochs: 15 }); // each an ort.Tensor: uint8 [n, 8, 8], int64 [n]

const session = await TrainingSession.create({ ort, artifacts: folder });
const schedule = makeSchedule('cosine', session, { warmupSteps: 30, totalSteps: batches.length });
for (const { images, labels } of batches) {
  const { loss } = await session.runTrainStep({ images, labels });
  await session.runOptimizerStep();
  session.lazyResetGrad();
  schedule.step();
  if (session.checkpointState.step % 135 === 0) console.log(`step ${session.checkpointState.step}: loss ${Number(loss.data[0]).toFixed(4)}`);
}
const { logits } = await session.runEvalStep(test); // Dropout off, BatchNorm frozen
await session.saveCheckpoint(`${folder}/trained.ckpt`); // graphforge.CheckpointState.load reads it
const shared = await session.getContiguousParameters(); // federated averaging's buffer
console.log(`test accuracy ${accuracy(logits, test.labels).toFixed(4)}; ${shared.dims[0]} parameters; checkpoint ${folder}/trained.ckpt`);
await session.release();
