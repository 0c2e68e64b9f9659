// Learning-rate schedules with linear warmup, the values graphforge's Python schedules give
// (graphforge/runtime/lr_schedules.py): constant, linear, polynomial and cosine decay. A
// schedule built on a session sets its rate at once, and step(), called after each optimizer
// step, advances it: the k-th optimizer step (0-based) runs with lrAt(k).
import { OndeviceError } from './errors.js';

/**
 * @typedef {import('../types/index.js').ScheduleOptions} ScheduleOptions
 * @typedef {import('../types/index.js').ScheduleState} ScheduleState
 * @typedef {{setLearningRate(lr: number): void, getLearningRate(): number} | null} Sink what a schedule sets its rate on
 * @typedef {'constant' | 'linear' | 'polynomial' | 'cosine'} Kind
 */

/** @typedef {(schedule: Schedule, t: number, span: number) => number} Decay the rate ``t`` steps into the decay of ``span`` */

class Schedule {
  /** @type {Sink} */ #session;
  /** @type {Decay} */ #decay;
  /** @type {boolean} */ #needsTotal;

  /**
   * @param {Sink} session
   * @param {ScheduleOptions} options
   * @param {Kind} kind
   * @param {Decay | null} decay (null: none, the constant schedule's)
   */
  constructor(session, { baseLr, warmupSteps = 0, warmupStartFactor = 0, totalSteps = null, endLr = 0, lastStep = 0 }, kind, decay) {
    if (baseLr === undefined || baseLr === null) {
      if (!session) throw new OndeviceError(`the ${kind} schedule needs baseLr or a session to take it from`);
      baseLr = session.getLearningRate();
    }
    this.#session = session;
    this.#needsTotal = decay !== null;
    this.#decay = decay ?? ((schedule) => schedule.baseLr);
    /** @readonly */
    this.kind = kind;
    /** @readonly */
    this.baseLr = number('baseLr', baseLr, 0);
    /** @readonly */
    this.warmupSteps = count('warmupSteps', warmupSteps);
    /** @readonly */
    this.warmupStartFactor = number('warmupStartFactor', warmupStartFactor, 0, 1);
    /** @readonly */
    this.endLr = number('endLr', endLr, 0);
    /** @readonly */
    this.totalSteps = totalSteps === null ? null : count('totalSteps', totalSteps);
    if (this.#needsTotal && this.totalSteps === null) throw new OndeviceError(`the ${kind} schedule needs totalSteps (the step where the decay ends)`);
    if (this.#needsTotal && /** @type {number} */ (this.totalSteps) <= this.warmupSteps) {
      throw new OndeviceError(`totalSteps (${this.totalSteps}) must be larger than warmupSteps (${this.warmupSteps})`);
    }
    this.lastStep = count('lastStep', lastStep);
    this.#apply();
  }

  /** The rate of optimizer step ``step`` (0-based).
   * @param {number} step
   * @returns {number} */
  lrAt(step) {
    if (step < this.warmupSteps) {
      const start = this.warmupStartFactor;
      return this.baseLr * (start + ((1.0 - start) * step) / this.warmupSteps);
    }
    if (!this.#needsTotal) return this.#decay(this, step - this.warmupSteps, 1);
    const span = /** @type {number} */ (this.totalSteps) - this.warmupSteps;
    return this.#decay(this, Math.min(step - this.warmupSteps, span), span);
  }

  /** The rates of the next ``k`` optimizer steps, the schedule left where it is: what
   * runSteps(feeds, k, {learningRates}) takes (then step() k times).
   * @param {number} k
   * @returns {number[]} */
  nextRates(k) {
    return Array.from({ length: count('k', k) }, (_, i) => this.lrAt(this.lastStep + i));
  }

  /** Advance one optimizer step; sets and returns the rate of the next one. */
  step() {
    this.lastStep += 1;
    return this.#apply();
  }

  /** Set the rate of the step the schedule stands at; returns it. */
  #apply() {
    const lr = this.lrAt(this.lastStep);
    if (this.#session) this.#session.setLearningRate(lr);
    return lr;
  }

  /** @returns {ScheduleState} */
  stateDict() {
    return {
      kind: this.kind,
      base_lr: this.baseLr,
      warmup_steps: this.warmupSteps,
      warmup_start_factor: this.warmupStartFactor,
      total_steps: this.totalSteps,
      end_lr: this.endLr,
      last_step: this.lastStep,
    };
  }
}

export class ConstantSchedule extends Schedule {
  /** @param {Sink} session @param {ScheduleOptions} [options] */
  constructor(session, options = {}) {
    super(session, options, 'constant', null);
  }
}

export class LinearSchedule extends Schedule {
  /** @param {Sink} session @param {ScheduleOptions} [options] */
  constructor(session, options = {}) {
    super(session, options, 'linear', (s, t, span) => s.endLr + (s.baseLr - s.endLr) * (1.0 - t / span));
  }
}

export class PolynomialSchedule extends Schedule {
  /** @param {Sink} session @param {ScheduleOptions} [options] */
  constructor(session, { power = 1.0, ...options } = {}) {
    const checked = number('power', power, 0);
    super(session, options, 'polynomial', (s, t, span) => s.endLr + (s.baseLr - s.endLr) * (1.0 - t / span) ** checked);
    /** @readonly */
    this.power = checked;
  }

  /** @returns {ScheduleState} */
  stateDict() {
    return { ...super.stateDict(), power: this.power };
  }
}

export class CosineSchedule extends Schedule {
  /** @param {Sink} session @param {ScheduleOptions} [options] */
  constructor(session, options = {}) {
    super(session, options, 'cosine', (s, t, span) => s.endLr + ((s.baseLr - s.endLr) * (1.0 + Math.cos((Math.PI * t) / span))) / 2.0);
  }
}

const KINDS = { constant: ConstantSchedule, linear: LinearSchedule, polynomial: PolynomialSchedule, cosine: CosineSchedule };

/** A schedule by kind ('constant', 'linear', 'polynomial', 'cosine').
 * @param {Kind} kind
 * @param {Sink} session
 * @param {ScheduleOptions} [options]
 * @returns {import('../types/index.js').Schedule} */
export function makeSchedule(kind, session, options) {
  const Kind = KINDS[kind];
  if (!Kind) throw new OndeviceError(`unknown learning-rate schedule '${kind}'; known: ${Object.keys(KINDS).join(', ')}`);
  return new Kind(session, options);
}

/** A schedule from its state (stateDict(), as graphforge's checkpoints keep it in ``scheduler``).
 * @param {ScheduleState} state
 * @param {Sink} session
 * @returns {import('../types/index.js').Schedule} */
export function scheduleFromState(state, session) {
  const { kind, base_lr, warmup_steps, warmup_start_factor, total_steps, end_lr, last_step, power } = state;
  return makeSchedule(/** @type {Kind} */ (kind), session, {
    baseLr: base_lr,
    warmupSteps: warmup_steps,
    warmupStartFactor: warmup_start_factor,
    totalSteps: total_steps,
    endLr: end_lr,
    lastStep: last_step,
    ...(power === undefined ? {} : { power }),
  });
}

/** @param {string} name @param {unknown} value @param {number} minimum @param {number} [maximum] @returns {number} */
function number(name, value, minimum, maximum = Infinity) {
  if (typeof value !== 'number' || !Number.isFinite(value) || value < minimum || value > maximum) {
    throw new OndeviceError(`${name} must be a number in [${minimum}, ${maximum}], got ${value}`);
  }
  return value;
}

/** @param {string} name @param {unknown} value @returns {number} */
function count(name, value) {
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 0) throw new OndeviceError(`${name} must be a whole number ≥ 0, got ${value}`);
  return value;
}
