// The coordinator's admin API as the dashboard reads it: JSON over fetch with the operator
// token, and the live event stream (server-sent events read through fetch, because
// EventSource cannot send an Authorization header).

export interface RunView {
  id: number;
  name: string | null;
  population: string;
  status: string;
  /** Why the coordinator stopped the run (rounds failing in a row, accounting or a close
   *  failing); absent when the operator stopped it or it has not stopped. */
  stop_reason?: string;
  model_version: number;
  rounds_committed: number;
  total_rounds: number;
  created_at_ms: number;
  plan: Record<string, unknown>;
  /** A differentially private run's ε so far (absent for other runs). */
  privacy?: {
    epsilon: number;
    delta: number;
    epsilon_budget: number | null;
    rounds_allowed: number;
    sampling_rate: number;
    noise_multiplier: number;
    mechanism: string;
    /** The sampling and neighbouring relation the accountant composes. */
    accounting: string;
    /** What the run releases beside its model: withheld, or noised in the same accounting. */
    metrics: string;
    /** Against whom `epsilon` holds. */
    holds_against: string;
    /** Distributed noise: ε against the coordinator, which knows each cohort (no amplification). */
    against_coordinator?: {
      expected_participations: number;
      epsilon_expected: number;
      epsilon_every_round: number;
    };
  };
}

export interface RoundView {
  round_idx: number;
  model_version: number;
  state: string;
  opened_at_ms: number;
  selection_deadline_ms: number;
  reporting_deadline_ms: number;
  closed_at_ms: number | null;
  /** Null in a differentially private run with Poisson selection: its cohort sizes are not shown. */
  n_selected: number | null;
  n_reported: number | null;
  n_dropped: number | null;
  /** Updates trained on an earlier model (asynchronous runs). */
  n_stale: number;
  outcome: unknown;
  metrics: Record<string, number> | null;
  n_rejected?: number;
  upload_bytes?: number;
}

export interface ModelView {
  version: number;
  content_hash: string;
  round_idx: number | null;
  created_at_ms: number;
  /** Its bytes were given up: the run writes every `checkpoint_interval` versions and a later one is written. */
  given_up?: boolean;
  n_evaluations: number;
  evaluation: Record<string, number>;
  /** Central evaluations: evaluators' own held-out sets (`starling-client evaluate`, the simulator). */
  central?: CentralEvaluation[];
  /** How devices' own accuracies spread (each device once; a personalized run's with its own local tensors). */
  device_accuracy?: DeviceSpread;
}

export interface DeviceSpread {
  devices: number;
  mean: number;
  std: number;
  min: number;
  max: number;
}

export interface CentralEvaluation {
  evaluator: string;
  example_count: number;
  metrics: Record<string, number>;
}

export type ModelFormat = 'safetensors' | 'payload';

/** An enrollment token as the admin API lists it (never the token itself). */
export interface EnrollmentTokenView {
  id: string;
  created_at_ms: number;
  expires_at_ms: number | null;
  /** Null only for tokens from before limits were required: unlimited. */
  uses_left: number | null;
  /** Null only for tokens from before tokens named populations: any. */
  populations: string[] | null;
}

export interface PopulationSample {
  at_ms: number;
  online: number;
  eligible: number;
  participating: number;
}

export type LiveEvent =
  | { type: 'run'; run_id: number; state: string }
  | { type: 'round'; run_id: number; round_idx: number; state: string }
  | { type: 'evaluation'; run_id: number; version: number }
  | ({ type: 'population' } & PopulationSample);

export class Unauthorized extends Error {}

export class Api {
  constructor(private readonly token: string) {}

  private async fetchOk(path: string): Promise<Response> {
    const res = await fetch(path, { headers: { Authorization: `Bearer ${this.token}` } });
    if (res.status === 401) throw new Unauthorized('the operator token was refused');
    if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
    return res;
  }

  private async get<T>(path: string): Promise<T> {
    return (await (await this.fetchOk(path)).json()) as T;
  }

  /** A committed model as a file (the download needs the operator token, so no plain link). */
  async modelFile(run: number, version: number, format: ModelFormat): Promise<Blob> {
    return (await this.fetchOk(`/v1/admin/runs/${run}/models/${version}?format=${format}`)).blob();
  }

  runs(): Promise<RunView[]> {
    return this.get('/v1/admin/runs');
  }
  rounds(run: number): Promise<RoundView[]> {
    return this.get(`/v1/admin/runs/${run}/rounds`);
  }
  models(run: number): Promise<ModelView[]> {
    return this.get(`/v1/admin/runs/${run}/models`);
  }
  population(): Promise<PopulationSample[]> {
    return this.get('/v1/admin/population');
  }
  enrollmentTokens(): Promise<EnrollmentTokenView[]> {
    return this.get('/v1/admin/enrollment-tokens');
  }

  /** Streams live events until `signal` aborts; reconnects with backoff. */
  async stream(
    onEvent: (e: LiveEvent) => void,
    onReload: () => void,
    onStatus: (s: string) => void,
    signal: AbortSignal,
  ): Promise<void> {
    let backoff = 500;
    while (!signal.aborted) {
      try {
        const res = await fetch('/v1/admin/events', {
          headers: { Authorization: `Bearer ${this.token}`, Accept: 'text/event-stream' },
          signal,
        });
        if (res.status === 401) throw new Unauthorized('the operator token was refused');
        if (!res.ok || !res.body) throw new Error(`events: HTTP ${res.status}`);
        onStatus('live');
        // Whatever happened while disconnected is fetched again.
        onReload();
        backoff = 500;
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let end: number;
          while ((end = buffer.indexOf('\n\n')) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end + 2);
            let name = 'message';
            const data: string[] = [];
            for (const line of block.split('\n')) {
              if (line.startsWith('event:')) name = line.slice(6).trim();
              else if (line.startsWith('data:')) data.push(line.slice(5).trimStart());
            }
            if (name === 'update' && data.length) onEvent(JSON.parse(data.join('\n')) as LiveEvent);
            else if (name === 'reload') onReload();
          }
        }
      } catch (e) {
        if (signal.aborted) return;
        if (e instanceof Unauthorized) throw e;
      }
      onStatus('reconnecting…');
      await new Promise((r) => setTimeout(r, backoff));
      backoff = Math.min(backoff * 2, 10_000);
    }
  }
}
