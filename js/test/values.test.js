// Values graphforge's Python side computed: the schedules' rates and the dropout keys.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { OndeviceError, makeSchedule, runKey, scheduleFromState } from '../src/index.js';
import { skip, values } from './fixtures.js';

test('each schedule gives the Python schedule\'s rates', { skip }, () => {
  for (const { kind, options, rates } of values.schedules) {
    const schedule = makeSchedule(kind, null, options);
    assert.deepEqual(rates.map((_, k) => schedule.lrAt(k)), rates, kind);
    const again = scheduleFromState(schedule.stateDict(), null);
    assert.equal(again.lrAt(7), schedule.lrAt(7), kind);
  }
});

test('the dropout keys are Python\'s run_key', { skip }, () => {
  for (const { seed, step, micro, replica, key } of values.keys) {
    assert.deepEqual([...runKey(seed, step, micro, replica)], key);
  }
});

test('a schedule refuses what it cannot do', () => {
  assert.throws(() => makeSchedule('cosine', null, { baseLr: 0.1 }), OndeviceError);
  assert.throws(() => makeSchedule('linear', null, { baseLr: 0.1, warmupSteps: 5, totalSteps: 5 }), /totalSteps \(5\) must be larger than warmupSteps \(5\)/);
  assert.throws(() => makeSchedule('step', null, { baseLr: 0.1 }), /unknown learning-rate schedule 'step'/);
});
