// The Starling dashboard: operator sign-in, runs, a run's accuracy and loss curves and round
// timeline, and the device population — kept current by the coordinator's live event stream.
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';
import './style.css';
import { Api, DeviceSpread, EnrollmentTokenView, LiveEvent, ModelFormat, ModelView, PopulationSample, RoundView, RunView, Unauthorized } from './api';

const TOKEN_KEY = 'starling-operator-token';
const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;

let api: Api | null = null;
let selectedRun: number | null = null;
let live: AbortController | null = null;
let refreshTimer: number | undefined;
let population: PopulationSample[] = [];
const charts = new Map<string, uPlot>();

function showLogin(message = ''): void {
  live?.abort();
  live = null;
  api = null;
  sessionStorage.removeItem(TOKEN_KEY);
  // Nothing of the previous session stays on the page.
  for (const chart of charts.values()) chart.destroy();
  charts.clear();
  $('app').hidden = true;
  $('logout').hidden = true;
  $('login').hidden = false;
  $('live-status').textContent = '';
  $('login-error').textContent = message;
}

async function signIn(token: string): Promise<void> {
  const candidate = new Api(token);
  try {
    await candidate.runs();
  } catch (e) {
    showLogin(e instanceof Unauthorized ? 'That operator token was refused.' : `Cannot reach the coordinator: ${e}`);
    return;
  }
  api = candidate;
  sessionStorage.setItem(TOKEN_KEY, token);
  $('login').hidden = true;
  $('app').hidden = false;
  $('logout').hidden = false;
  population = await candidate.population();
  await refresh();
  live = new AbortController();
  candidate
    .stream(onLiveEvent, scheduleRefresh, (s) => ($('live-status').textContent = s), live.signal)
    .catch((e) => showLogin(e instanceof Unauthorized ? 'The operator token is no longer accepted.' : String(e)));
}

function onLiveEvent(e: LiveEvent): void {
  if (e.type === 'population') {
    population.push(e);
    if (population.length > 1800) population.shift();
    renderPopulation();
  } else {
    scheduleRefresh();
  }
}

function scheduleRefresh(): void {
  window.clearTimeout(refreshTimer);
  refreshTimer = window.setTimeout(() => void refresh(), 150);
}

async function refresh(): Promise<void> {
  if (!api) return;
  try {
    const runs = await api.runs();
    if (selectedRun === null && runs.length) selectedRun = Math.max(...runs.map((r) => r.id));
    const detail =
      selectedRun === null ? null : await Promise.all([api.rounds(selectedRun), api.models(selectedRun)]);
    const latestModels = await Promise.all(runs.map((r) => (r.id === selectedRun && detail ? detail[1] : api!.models(r.id))));
    renderRuns(runs, latestModels);
    const run = runs.find((r) => r.id === selectedRun);
    if (run && detail) renderRun(run, detail[0], detail[1]);
    renderPopulation();
    renderTokens(await api.enrollmentTokens());
  } catch (e) {
    if (e instanceof Unauthorized) showLogin('The operator token is no longer accepted.');
  }
}

function accuracyOf(models: ModelView[]): number | undefined {
  const evaluated = models.filter((m) => m.evaluation.accuracy !== undefined);
  return evaluated.length ? evaluated[evaluated.length - 1].evaluation.accuracy : undefined;
}

const pct = (x: number | undefined) => (x === undefined ? '–' : `${(x * 100).toFixed(1)}%`);

function cell(row: HTMLTableRowElement, text: string): HTMLTableCellElement {
  const c = row.insertCell();
  c.textContent = text;
  return c;
}

/** Each token's limit in plain sight: how many devices it may still enroll, and where they may join. */
function renderTokens(tokens: EnrollmentTokenView[]): void {
  const body = $('tokens').querySelector('tbody')!;
  body.replaceChildren();
  for (const t of tokens) {
    const row = body.insertRow();
    row.dataset.tokenId = t.id;
    cell(row, t.id);
    cell(row, new Date(t.created_at_ms).toLocaleString());
    cell(row, t.populations === null ? 'any (issued before tokens named populations)' : t.populations.join(', '));
    cell(row, t.uses_left === null ? 'unlimited' : String(t.uses_left));
    cell(row, t.expires_at_ms === null ? 'never' : new Date(t.expires_at_ms).toLocaleString());
  }
}

function renderRuns(runs: RunView[], models: ModelView[][]): void {
  const body = $('runs').querySelector('tbody')!;
  body.replaceChildren();
  runs.forEach((run, i) => {
    const row = body.insertRow();
    row.dataset.runId = String(run.id);
    row.className = run.id === selectedRun ? 'selected' : '';
    cell(row, `#${run.id}`);
    cell(row, run.name ?? '');
    cell(row, run.status).title = run.stop_reason ?? '';
    cell(row, `${run.rounds_committed} / ${run.total_rounds} rounds`);
    cell(row, `v${run.model_version}`);
    cell(row, pct(accuracyOf(models[i])));
    row.addEventListener('click', () => {
      selectedRun = run.id;
      void refresh();
    });
  });
}

function renderRun(run: RunView, rounds: RoundView[], models: ModelView[]): void {
  $('run-detail').hidden = false;
  $('run-title').textContent = `Run #${run.id}${run.name ? ` — ${run.name}` : ''} (${run.status})`;
  // A run the coordinator stopped says why, where the operator looks first.
  const stopReason = $('run-stop-reason');
  stopReason.hidden = !run.stop_reason;
  stopReason.textContent = run.stop_reason ? `Stopped by the coordinator: ${run.stop_reason}` : '';
  renderSettings(run);
  const byVersion = new Map(models.map((m) => [m.version, m]));
  // An evaluation-only run's rounds are "evaluated": their metrics are the devices' pooled
  // evaluation of the one model, and nothing trained.
  const committed = rounds
    .filter((r) => r.state === 'committed' || r.state === 'evaluated')
    .sort((a, b) => a.round_idx - b.round_idx);
  const xs = committed.map((r) => r.round_idx);
  const evalOf = (r: RoundView, key: string) =>
    r.state === 'evaluated' ? r.metrics?.[key] ?? null : byVersion.get(r.model_version)?.evaluation[key] ?? null;
  const accuracy = committed.map((r) => evalOf(r, 'accuracy'));
  const central = committed.map((r) => centralAccuracy(byVersion.get(r.model_version)) ?? null);
  const chart = $('accuracy-chart');
  chart.dataset.points = String(accuracy.filter((a) => a !== null).length);
  chart.dataset.centralPoints = String(central.filter((a) => a !== null).length);
  chart.dataset.committedRounds = String(committed.length);
  draw(
    'accuracy-chart',
    [xs, accuracy, central],
    [
      { label: 'federated accuracy', stroke: '#1f77b4', scale: 'acc' },
      { label: 'central accuracy', stroke: '#9467bd', scale: 'acc', dash: [6, 4] },
    ],
    { acc: { range: [0, 1] } },
  );
  draw(
    'loss-chart',
    [
      xs,
      committed.map((r) => (r.state === 'evaluated' ? null : r.metrics?.loss ?? null)),
      committed.map((r) => evalOf(r, 'loss')),
    ],
    [
      { label: 'training loss', stroke: '#d62728' },
      { label: 'evaluation loss', stroke: '#2ca02c' },
    ],
  );
  renderTimeline(rounds, byVersion);
  renderModels(run, models);
}

/** The mean accuracy the central evaluators report for a model. */
function centralAccuracy(model: ModelView | undefined): number | undefined {
  const accuracies = (model?.central ?? []).map((c) => c.metrics.accuracy).filter((a) => a !== undefined);
  return accuracies.length ? accuracies.reduce((a, b) => a + b, 0) / accuracies.length : undefined;
}

/** Devices' accuracies on a model: their mean ± standard deviation, and the lowest and highest. */
function deviceSpread(spread: DeviceSpread | undefined): string {
  if (!spread) return '–';
  const p = (v: number) => (v * 100).toFixed(1);
  return `${p(spread.mean)}% ± ${p(spread.std)} (${p(spread.min)}–${p(spread.max)}%, ${spread.devices} devices)`;
}

/** Committed models, newest first, each with its evaluations and downloads. */
function renderModels(run: RunView, models: ModelView[]): void {
  const body = $('models').querySelector('tbody')!;
  body.replaceChildren();
  for (const m of [...models].sort((a, b) => b.version - a.version)) {
    const row = body.insertRow();
    row.dataset.version = String(m.version);
    cell(row, `v${m.version}`);
    cell(row, m.round_idx === null ? 'initial' : String(m.round_idx));
    cell(row, pct(m.evaluation.accuracy));
    cell(row, pct(centralAccuracy(m)));
    cell(row, (m.central ?? []).map((c) => c.evaluator).join(', ') || '–');
    cell(row, deviceSpread(m.device_accuracy));
    const actions = row.insertCell();
    if (m.given_up) {
      // Its run's checkpoint interval gave its bytes up: nothing to download.
      actions.textContent = 'not kept';
      actions.className = 'not-kept';
      actions.title = `Model v${m.version} was not kept: the run writes a model every few versions and a later one is written`;
      continue;
    }
    for (const format of ['safetensors', 'payload'] as ModelFormat[]) {
      const button = document.createElement('button');
      button.className = `download-${format}`;
      button.textContent = format;
      button.title = `Download model v${m.version} as ${format === 'safetensors' ? 'safetensors' : 'the raw CBOR payload'}`;
      button.addEventListener('click', () => void download(run.id, m.version, format));
      actions.append(button);
    }
  }
}

async function download(run: number, version: number, format: ModelFormat): Promise<void> {
  if (!api) return;
  try {
    const blob = await api.modelFile(run, version, format);
    const url = URL.createObjectURL(blob);
    const a = document.createElement('a');
    a.href = url;
    a.download = `run-${run}-model-${version}.${format === 'safetensors' ? 'safetensors' : 'cbor'}`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (e) {
    if (e instanceof Unauthorized) showLogin('The operator token is no longer accepted.');
    else $('live-status').textContent = `download failed: ${e}`;
  }
}

const OPTIMIZER_NAMES: Record<string, string> = {
  fed_avg: 'FedAvg',
  fed_avg_m: 'FedAvgM',
  fed_adagrad: 'FedAdagrad',
  fed_adam: 'FedAdam',
  fed_yogi: 'FedYogi',
};

/** The plan's server optimizer and its hyper-parameters, in words. */
function strategyText(plan: Record<string, any>): string {
  if (plan.evaluation_only) return 'evaluation only: devices evaluate the model, nothing trains';
  const optimizer = (plan.strategy?.optimizer ?? { kind: 'fed_avg' }) as Record<string, unknown>;
  const { kind, ...params } = optimizer;
  if (kind === 'fed_avg' && params.lr == null) params.lr = plan.server_learning_rate ?? 1;
  const name = OPTIMIZER_NAMES[String(kind)] ?? String(kind);
  const listed = Object.entries(params).map(([k, v]) => `${k} ${v}`).join(', ');
  const aggregation = (plan.strategy?.aggregation ?? { kind: 'mean' }) as Record<string, unknown>;
  const { kind: how, ...aggParams } = aggregation;
  let over =
    how === 'mean'
      ? plan.strategy?.differential_privacy
        ? 'the unweighted mean of clipped updates'
        : 'the example-weighted mean delta'
      : `${String(how).replace(/_/g, ' ')} (${JSON.stringify(aggParams)})`;
  if (plan.strategy?.norm_bound != null) over += `, each update bounded to norm ${plan.strategy.norm_bound}`;
  return `${name} over ${over}; ${listed}`;
}

function privacyText(run: RunView): string {
  const plan = run.plan as Record<string, any>;
  const secure = plan.secure_aggregation
    ? `secure aggregation: ${JSON.stringify(plan.secure_aggregation)}`
    : 'secure aggregation off: the coordinator sees each update (examples never leave devices)';
  const p = run.privacy;
  if (!p) return secure;
  const budget = p.epsilon_budget == null ? 'no budget' : `budget ${p.epsilon_budget}`;
  const c = p.against_coordinator;
  const coordinator = c
    ? `against the coordinator (it knows each cohort): ε = ${c.epsilon_expected.toFixed(2)} after ` +
      `${c.expected_participations} participations, ${c.epsilon_every_round.toFixed(2)} for a device in every round`
    : 'no ε against the coordinator: it adds the noise to a sum it sees first';
  return (
    `differential privacy: ε = ${p.epsilon.toFixed(3)} at δ = ${p.delta} against the devices and the released models; ` +
    `${coordinator} (${budget}, ` +
    `${p.rounds_allowed} rounds allowed; q = ${p.sampling_rate}, z = ${p.noise_multiplier}; ` +
    `${p.mechanism}; accounted as ${p.accounting}; metrics ${p.metrics}); ${secure}`
  );
}

// A plan's `compression` or `model_download` (absent: f32).
function encodingText(c: { kind: string; block?: number; fraction?: number } | undefined): string {
  if (!c) return 'f32';
  if (c.kind === 'int8') return `int8 (block ${c.block ?? 256})`;
  if (c.kind === 'top_k') return `top-k ${(100 * (c.fraction ?? 0)).toFixed(1)} %`;
  return c.kind;
}

// A FedBuff run's rounds are buffers: each commits K updates, some trained on earlier models.
function modeText(plan: Record<string, any>): string {
  const a = plan.asynchronous as { concurrency: number; max_staleness: number; staleness_exponent?: number } | undefined;
  if (!a) return 'synchronous rounds';
  return `asynchronous (FedBuff): ${a.concurrency} devices training at once, updates up to ${a.max_staleness} versions stale, ` +
    `weighted (1 + staleness)^-${a.staleness_exponent ?? 0.5}`;
}

// A plan's `checkpoint_interval` (absent: 1): which versions' bytes the store keeps.
function checkpointText(interval: number | undefined): string {
  if (!interval || interval <= 1) return 'every version';
  return `every ${interval} versions and the last (the newest is served from memory until its bytes are written; ` +
    'the versions between are not kept)';
}

function renderSettings(run: RunView): void {
  const plan = run.plan as Record<string, any>;
  const training = (plan.training ?? {}) as Record<string, unknown>;
  const settings: [string, string][] = [
    ['Population', run.population],
    ['Strategy', strategyText(plan)],
    ['Local training', Object.entries(training).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join(', ') || 'SDK defaults'],
    ['FedProx μ', String(training.fedprox_mu ?? 0)],
    ['Mode', modeText(plan)],
    ['Encoding', `uploads ${encodingText(plan.compression)}, model downloaded in ${encodingText(plan.model_download)}`],
    ['Cohort', plan.asynchronous
      ? `${plan.cohort_size} updates per buffer`
      : `${plan.cohort_size} reports, over-selection ×${plan.over_selection}, quorum ${plan.min_quorum ?? plan.cohort_size}`],
    ['Deadlines', `selection ${plan.selection_timeout_secs} s, reporting ${plan.reporting_timeout_secs} s`],
    ['Models kept', checkpointText(plan.checkpoint_interval)],
    ['Privacy', privacyText(run)],
  ];
  const dl = $('run-settings');
  dl.replaceChildren();
  for (const [k, v] of settings) {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = v;
    dl.append(dt, dd);
  }
}

const seconds = (ms: number) => `${(ms / 1000).toFixed(1)} s`;
const bytes = (n: number | undefined) =>
  n === undefined ? '–' : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / 1024).toFixed(1)} KiB`;

function renderTimeline(rounds: RoundView[], byVersion: Map<number, ModelView>): void {
  const body = $('rounds').querySelector('tbody')!;
  body.replaceChildren();
  for (const r of [...rounds].sort((a, b) => b.round_idx - a.round_idx)) {
    const row = body.insertRow();
    row.className = r.state;
    cell(row, String(r.round_idx));
    cell(row, r.state);
    cell(row, `v${r.model_version}`);
    cell(row, r.closed_at_ms === null ? `open ${seconds(Date.now() - r.opened_at_ms)}` : seconds(r.closed_at_ms - r.opened_at_ms));
    const produced = byVersion.get(r.model_version + 1);
    cell(row, r.state === 'committed' && produced && r.closed_at_ms !== null ? seconds(produced.created_at_ms - r.closed_at_ms) : '–');
    cell(row, r.n_selected === null ? '–' : String(r.n_selected));
    cell(row, r.n_reported === null ? '–' : String(r.n_reported));
    cell(row, String(r.n_stale));
    cell(row, r.n_dropped === null ? '–' : String(r.n_dropped));
    cell(row, r.n_rejected === undefined ? '–' : String(r.n_rejected));
    cell(row, bytes(r.upload_bytes));
    cell(row, r.metrics?.loss === undefined ? '–' : r.metrics.loss.toFixed(4));
  }
}

function renderPopulation(): void {
  if (!api) return;
  const xs = population.map((p) => p.at_ms / 1000);
  const chart = $('population-chart');
  chart.dataset.points = String(population.length);
  draw(
    'population-chart',
    [xs, population.map((p) => p.online), population.map((p) => p.eligible), population.map((p) => p.participating)],
    [
      { label: 'online', stroke: '#1f77b4' },
      { label: 'eligible', stroke: '#ff7f0e' },
      { label: 'participating', stroke: '#2ca02c' },
    ],
    {},
    true,
  );
}

/** Creates the chart in `id` once, then only swaps its data. */
function draw(id: string, data: (number | null)[][], series: uPlot.Series[], scales: uPlot.Scales = {}, time = false): void {
  const existing = charts.get(id);
  if (existing) {
    existing.setData(data as uPlot.AlignedData);
    return;
  }
  const el = $(id);
  const opts: uPlot.Options = {
    width: Math.max(320, Math.min(640, el.clientWidth || 560)),
    height: 240,
    scales: { x: { time }, ...scales },
    series: [{ label: time ? 'time' : 'round' }, ...series.map((s) => ({ width: 2, points: { show: true }, ...s }))],
    // Rounds are whole numbers.
    axes: [time ? {} : { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500] }, { scale: series[0].scale ?? 'y' }],
  };
  charts.set(id, new uPlot(opts, data as uPlot.AlignedData, el));
}

$('login-form').addEventListener('submit', (e) => {
  e.preventDefault();
  void signIn($<HTMLInputElement>('token').value.trim());
});
$('logout').addEventListener('click', () => showLogin());

const saved = sessionStorage.getItem(TOKEN_KEY);
if (saved) void signIn(saved);
else showLogin();
