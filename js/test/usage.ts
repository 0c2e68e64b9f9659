// The loop of js/README.md and docs/on-device/training.md, typed: `npm run typecheck` checks the declarations against how they are used.
import * as ort from 'onnxruntime-node';
import { CheckpointState, TrainingSession, makeSchedule } from '@graphforge/ondevice';

export async function train(folder: string, images: Uint8Array, labels: BigInt64Array, count: number): Promise<number> {
  const session = await TrainingSession.create({ ort, artifacts: folder });
  const schedule = makeSchedule('cosine', session, { warmupSteps: 10, totalSteps: 100 });
  let loss = Number.NaN;
  for (let step = 0; step < 100; step++) {
    const feeds = {
      images: new ort.Tensor('uint8', images, [count, 8, 8]),
      labels: new ort.Tensor('int64', labels, [count]),
    };
    const out = await session.runTrainStep(feeds);
    loss = Number(out.loss.data[0]);
    await session.runOptimizerStep();
    session.lazyResetGrad();
    schedule.step();
  }
  const averaged = await session.getContiguousParameters(true);
  await session.loadParametersBuffer(averaged.data as Float32Array);
  const state: CheckpointState = session.checkpointState;
  await state.save(`${folder}/trained.ckpt`);
  await session.release();
  return loss;
}
