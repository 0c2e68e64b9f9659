// Learning-rate schedules with linear warmup, the values graphforge's Python schedules give
// (graphforge/runtime/lr_schedules.py): constant, linear, polynomial and cosine decay. A
// schedule built on a session sets its rate at once, and step(), called after each optimizer
// step, advances it: the k-th optimizer step (0-based) runs with lrAt(k).
import { OndeviceError } from './errors.js';

class Schedule {
  constructor(session, { baseLr, warmupSteps = 0, warmupStartFactor = 0, totalSteps = null, endLr = 0, lastStep = 0 } = {}, kind, needsTotal) {
    if (baseLr === undefined || baseLr === null) {
      if (!session) throw new OndeviceError(`the ${kind} schedule needs baseLr or a session to take it from`);
      baseLr = session.getLearningRate();
    }
    this.kind = kind;
    this.needsTotal = needsTotal;
    this.session = session;
    this.baseLr = number('baseLr', baseLr, 0);
    this.warmupSteps = count('warmupSteps', warmupSteps);
    this.warmupStartFactor = number('warmupStartFactor', warmupStartFactor, 0, 1);
    this.endLr = number('endLr', endLr, 0);
    this.totalSteps = totalSteps === null ? null : count('totalSteps', totalSteps);
    if (needsTotal && this.totalSteps === null) throw new OndeviceError(`the ${kind} schedule needs totalSteps (the step where the decay ends)`);
    if (needsTotal && this.totalSteps <= this.warmupSteps) {
      throw new OndeviceError(`totalSteps (${this.totalSteps}) must be larger than warmupSteps (${this.warmupSteps})`);
    }
    this.lastStep = count('lastStep', lastStep);
    this.apply();
  }

  /** The rate of optimizer step ``step`` (0-based). */
  lrAt(step) {
    if (step < this.warmupSteps) {
      const start = this.warmupStartFactor;
      return this.baseLr * (start + ((1.0 - start) * step) / this.warmupSteps);
    }
    if (!this.needsTotal) return this.decay(step - this.warmupSteps, 1);
    const span = this.totalSteps - this.warmupSteps;
    return this.decay(Math.min(step - this.warmupSteps, span), span);
  }

  /** Advance one optimizer step; sets and returns the rate of the next one. */
  step() {
    this.lastStep += 1;
    return this.apply();
  }

  apply() {
    const lr = this.lrAt(this.lastStep);
    if (this.session) this.session.setLearningRate(lr);
    return lr;
  }

  stateDict() {
    return {
      kind: this.kind,
      base_lr: this.baseLr,
      warmup_steps: this.warmupSteps,
      warmup_start_factor: this.warmupStartFactor,
      total_steps: this.totalSteps,
      end_lr: this.endLr,
      last_step: this.lastStep,
      ...this.extra(),
    };
  }

  extra() {
    return {};
  }
}

export class ConstantSchedule extends Schedule {
  constructor(session, options) {
    super(session, options, 'constant', false);
  }
  decay() {
    return this.baseLr;
  }
}

export class LinearSchedule extends Schedule {
  constructor(session, options) {
    super(session, options, 'linear', true);
  }
  decay(t, span) {
    return this.endLr + (this.baseLr - this.endLr) * (1.0 - t / span);
  }
}

export class PolynomialSchedule extends Schedule {
  constructor(session, { power = 1.0, ...options } = {}) {
    const checked = number('power', power, 0);
    super(session, options, 'polynomial', true);
    this.power = checked;
    this.apply();
  }
  decay(t, span) {
    return this.endLr + (this.baseLr - this.endLr) * (1.0 - t / span) ** (this.power ?? 1.0);
  }
  extra() {
    return { power: this.power };
  }
}

export class CosineSchedule extends Schedule {
  constructor(session, options) {
    super(session, options, 'cosine', true);
  }
  decay(t, span) {
    return this.endLr + ((this.baseLr - this.endLr) * (1.0 + Math.cos((Math.PI * t) / span))) / 2.0;
  }
}

const KINDS = { constant: ConstantSchedule, linear: LinearSchedule, polynomial: PolynomialSchedule, cosine: CosineSchedule };

/** A schedule by kind ('constant', 'linear', 'polynomial', 'cosine'). */
export function makeSchedule(kind, session, options) {
  const Kind = KINDS[kind];
  if (!Kind) throw new OndeviceError(`unknown learning-rate schedule '${kind}'; known: ${Object.keys(KINDS).join(', ')}`);
  return new Kind(session, options);
}

/** A schedule from its state (stateDict(), as graphforge's checkpoints keep it in ``scheduler``). */
export function scheduleFromState(state, session) {
  const { kind, base_lr, warmup_steps, warmup_start_factor, total_steps, end_lr, last_step, power } = state;
  return makeSchedule(kind, session, {
    baseLr: base_lr,
    warmupSteps: warmup_steps,
    warmupStartFactor: warmup_start_factor,
    totalSteps: total_steps,
    endLr: end_lr,
    lastStep: last_step,
    ...(power === undefined ? {} : { power }),
  });
}

function number(name, value, minimum, maximum = Infinity) {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < minimum || value > maximum) {
    throw new OndeviceError(`${name} must be a number in [${minimum}, ${maximum}], got ${value}`);
  }
  return value;
}

function count(name, value) {
  if (!Number.isInteger(value) || value < 0) throw new OndeviceError(`${name} must be a whole number ≥ 0, got ${value}`);
  return value;
}
