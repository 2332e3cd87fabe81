// The dashboard in a real headless Chromium against a coordinator running a short real
// training (the SDK's simulator: burn on the bundled digits). `cargo xtask test` runs this with
// the binaries' paths in STARLING_COORDINATOR_BIN and STARLING_CLIENT_BIN; screenshots go to
// STARLING_ARTIFACTS (default test-results/).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, existsSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { createServer } from 'node:net';
import { chromium } from 'playwright-core';

const root = resolve(import.meta.dirname, '..', '..');
const coordinatorBin = process.env.STARLING_COORDINATOR_BIN;
const clientBin = process.env.STARLING_CLIENT_BIN;
const chromiumPath = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium';
const artifacts = process.env.STARLING_ARTIFACTS ?? join(root, 'web-dashboard', 'test-results');
const token = `dashboard-test-operator-${process.pid}`;
const ROUNDS = 10;

let coordinator;
let base;
let browser;

const freePort = () =>
  new Promise((ok) => {
    const s = createServer().listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });

async function waitFor(what, check, timeoutMs = 60_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await check();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

const admin = (path) =>
  fetch(`${base}${path}`, { headers: { Authorization: `Bearer ${token}` } }).then((r) => r.json());

before(async () => {
  assert.ok(coordinatorBin && existsSync(coordinatorBin), 'STARLING_COORDINATOR_BIN must name the built coordinator');
  assert.ok(clientBin && existsSync(clientBin), 'STARLING_CLIENT_BIN must name the built client');
  assert.ok(existsSync(chromiumPath), `no Chromium at ${chromiumPath} (apt-get install chromium)`);
  mkdirSync(artifacts, { recursive: true });
  const port = await freePort();
  base = `http://127.0.0.1:${port}`;
  const dir = mkdtempSync(join(tmpdir(), 'starling-dashboard-'));
  coordinator = spawn(
    coordinatorBin,
    ['serve', '--insecure-http', '--listen', `127.0.0.1:${port}`, '--database-url', `sqlite://${join(dir, 'db.sqlite')}`,
      '--dashboard-dir', join(root, 'web-dashboard', 'dist')],
    { env: { ...process.env, STARLING_OPERATOR_TOKEN: token, RUST_LOG: 'warn' }, stdio: 'inherit' },
  );
  await waitFor('the coordinator', () => fetch(`${base}/healthz`).then((r) => r.ok, () => false));
  browser = await chromium.launch({
    executablePath: chromiumPath,
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
});

after(async () => {
  await browser?.close();
  coordinator?.kill('SIGTERM');
});

test('an unauthenticated visit sees nothing but the sign-in form', async () => {
  const page = await browser.newPage();
  await page.goto(`${base}/dashboard/`);
  await page.locator('#login').waitFor({ state: 'visible' });
  assert.equal(await page.locator('#app').isVisible(), false);
  assert.equal(await page.locator('#runs tbody tr').count(), 0);
  // A wrong token gets an error and still nothing.
  await page.fill('#token', 'not-the-operator-token');
  await page.click('#login-button');
  await page.locator('#login-error').filter({ hasText: 'refused' }).waitFor();
  assert.equal(await page.locator('#app').isVisible(), false);
  await page.screenshot({ path: join(artifacts, 'unauthenticated.png'), fullPage: true });
  // The data behind it needs the credential too.
  for (const path of ['/v1/admin/runs', '/v1/admin/events', '/v1/admin/population', '/v1/admin/enrollment-tokens', '/metrics']) {
    assert.equal((await fetch(`${base}${path}`)).status, 401, path);
  }
  await page.close();
});

test('a run trains live: it appears, its curves fill in round by round without a reload', async () => {
  const page = await browser.newPage();
  await page.goto(`${base}/dashboard/`);
  await page.fill('#token', token);
  await page.click('#login-button');
  await page.locator('#app').waitFor({ state: 'visible' });
  // Survives only as long as the page is not reloaded.
  await page.evaluate(() => (window.__sameDocument = true));

  const simulate = spawn(
    clientBin,
    ['simulate', '--url', base, '--clients', '8', '--cohort', '4', '--rounds', String(ROUNDS),
      '--dataset', 'digits', '--data-dir', join(root, 'client-sdk', 'data'), '--backend', 'cpu',
      // Enough local work that rounds take a moment, so the page sees them one by one.
      '--epochs', '10'],
    { env: { ...process.env, STARLING_OPERATOR_TOKEN: token }, stdio: 'inherit' },
  );
  const exited = new Promise((ok) => simulate.on('exit', ok));

  // The run appears without a reload.
  await page.locator('#runs tbody tr').first().waitFor({ timeout: 60_000 });
  const chart = page.locator('#accuracy-chart');
  const points = async () => Number((await chart.getAttribute('data-points')) ?? 0);
  await waitFor('a first committed round on the chart', async () => (await points()) >= 1);
  const first = await points();
  await page.screenshot({ path: join(artifacts, 'first-round.png'), fullPage: true });
  // A new round shows up, still in the same document.
  await waitFor('a further round on the chart', async () => (await points()) > first);
  assert.equal(await page.evaluate(() => window.__sameDocument), true);

  assert.equal(await exited, 0, 'the simulation failed');
  const [run] = await admin('/v1/admin/runs');
  assert.equal(run.status, 'finished');
  const committed = (await admin(`/v1/admin/runs/${run.id}/rounds`)).filter((r) => r.state === 'committed');
  assert.equal(committed.length, ROUNDS);
  // The chart catches up with the finished run: one point per committed round.
  await waitFor('the chart to show every committed round', async () => (await points()) === committed.length);
  assert.equal(Number(await chart.getAttribute('data-committed-rounds')), committed.length);
  await page.locator('#runs tbody tr', { hasText: 'finished' }).waitFor();
  assert.equal(await page.locator('#rounds tbody tr.committed').count(), committed.length);
  // The run's strategy is shown with its hyper-parameters (the simulator's plan: plain FedAvg).
  assert.match(await page.locator('#run-settings').textContent(), /FedAvg over the example-weighted mean delta; lr 1/);
  assert.match(await page.locator('#run-settings').textContent(), /uploads f32, model downloaded in f32/);
  assert.match(await page.locator('#run-settings').textContent(), /Models keptevery version/);
  assert.ok(Number(await page.locator('#population-chart').getAttribute('data-points')) >= 1);
  // The simulation's enrollment token is listed with its limit: the devices it may still enroll
  // (8 clients of 16 uses) and the one population they may join.
  const [issued] = await admin('/v1/admin/enrollment-tokens');
  assert.deepEqual([issued.uses_left, issued.populations], [8, [run.population]]);
  const tokenRow = page.locator(`#tokens tbody tr[data-token-id="${issued.id}"] td`);
  await waitFor('the token in the table', async () => (await tokenRow.count()) === 5);
  assert.deepEqual((await tokenRow.allTextContents()).filter((_, i) => i !== 1 && i !== 4),
    [issued.id, run.population, '8']);
  assert.equal(await page.evaluate(() => window.__sameDocument), true);
  // The simulator's test-set scores are central evaluations: a second curve beside the
  // federated one, for every round whose model it evaluated.
  const models = await admin(`/v1/admin/runs/${run.id}/models`);
  const centrallyEvaluated = committed.filter((r) => models[r.model_version].central.length > 0).length;
  assert.ok(centrallyEvaluated >= ROUNDS - 1, `${centrallyEvaluated} rounds with a central evaluation`);
  await waitFor('the central accuracy curve', async () =>
    Number(await chart.getAttribute('data-central-points')) === centrallyEvaluated);
  // The final model's central evaluation arrives after its round: the table shows it live.
  const finalCentral = page.locator(`#models tbody tr[data-version="${ROUNDS}"] td`).nth(3);
  const reported = models[ROUNDS].central[0].metrics.accuracy;
  await waitFor('the final model\'s central accuracy', async () =>
    (await finalCentral.textContent()) === `${(reported * 100).toFixed(1)}%`);
  // Each model the devices evaluated shows how their accuracies spread, as the API computes it.
  const spread = models.find((m) => m.device_accuracy);
  assert.ok(spread, 'a model with two or more device evaluations');
  const { mean, std, min, max, devices } = spread.device_accuracy;
  const p = (v) => (v * 100).toFixed(1);
  assert.equal(await page.locator(`#models tbody tr[data-version="${spread.version}"] td`).nth(5).textContent(),
    `${p(mean)}% ± ${p(std)} (${p(min)}–${p(max)}%, ${devices} devices)`);
  await page.screenshot({ path: join(artifacts, 'finished-run.png'), fullPage: true });

  // Every committed model can be downloaded: the file is the model the admin API serves.
  await page.locator('#models tbody tr').nth(ROUNDS).waitFor();
  assert.equal(await page.locator('#models tbody tr').count(), ROUNDS + 1);
  for (const [format, extension] of [['safetensors', 'safetensors'], ['payload', 'cbor']]) {
    const [download] = await Promise.all([
      page.waitForEvent('download'),
      page.click(`#models tbody tr[data-version="${ROUNDS}"] button.download-${format}`),
    ]);
    assert.equal(download.suggestedFilename(), `run-${run.id}-model-${ROUNDS}.${extension}`);
    const saved = readFileSync(await download.path());
    const served = Buffer.from(await (await fetch(`${base}/v1/admin/runs/${run.id}/models/${ROUNDS}?format=${format}`,
      { headers: { Authorization: `Bearer ${token}` } })).arrayBuffer());
    assert.ok(saved.length > 1000, `${format}: ${saved.length} bytes`);
    assert.ok(saved.equals(served), `${format}: the downloaded file differs from the served model`);
  }

  // Signing out leaves nothing on the page.
  await page.click('#logout');
  await page.locator('#login').waitFor({ state: 'visible' });
  assert.equal(await page.locator('#app').isVisible(), false);
  await page.close();
});

test('an asynchronous, compressed run shows its mode, encodings and each buffer\'s stale updates', async () => {
  const buffers = 8;
  const simulate = spawn(
    clientBin,
    ['simulate', '--url', base, '--clients', '10', '--cohort', '4', '--rounds', String(buffers),
      '--dataset', 'digits', '--data-dir', join(root, 'client-sdk', 'data'), '--backend', 'cpu',
      '--asynchronous', '6:4', '--slow', '0.2:5', '--seed', '17',
      '--compression', 'int8', '--model-download', 'f16', '--checkpoint-interval', '3'],
    { env: { ...process.env, STARLING_OPERATOR_TOKEN: token }, stdio: 'inherit' },
  );
  assert.equal(await new Promise((ok) => simulate.on('exit', ok)), 0, 'the simulation failed');
  const [run] = await admin('/v1/admin/runs');
  assert.deepEqual(run.plan.asynchronous, { concurrency: 6, max_staleness: 4, staleness_exponent: 0.5 });
  const rounds = await admin(`/v1/admin/runs/${run.id}/rounds`);
  const stale = rounds.reduce((n, r) => n + r.n_stale, 0);
  assert.ok(stale > 0, `no update crossed a buffer: ${JSON.stringify(rounds)}`);

  // Every third version and the last are written; the others are given up once a later one
  // is (the last write may land just after the run finishes).
  const givenUp = await waitFor('the versions between checkpoints given up', async () => {
    const models = await admin(`/v1/admin/runs/${run.id}/models`);
    const versions = models.filter((m) => m.given_up).map((m) => m.version);
    return versions.length === 5 ? versions : null;
  });
  assert.deepEqual(givenUp, [1, 2, 4, 5, 7]);

  // A fresh page shows the newest run: this one.
  const page = await browser.newPage();
  await page.goto(`${base}/dashboard/`);
  await page.fill('#token', token);
  await page.click('#login-button');
  await page.locator('#rounds tbody tr').nth(rounds.length - 1).waitFor();
  // Versions given up offer no download, and say why; the written ones do.
  for (const version of [0, 3, 6, 8]) {
    assert.equal(await page.locator(`#models tbody tr[data-version="${version}"] button.download-safetensors`).count(), 1, `v${version}`);
  }
  for (const version of givenUp) {
    assert.equal(await page.locator(`#models tbody tr[data-version="${version}"] td.not-kept`).textContent(), 'not kept');
  }
  assert.match(await page.locator('#run-settings').textContent(),
    /asynchronous \(FedBuff\): 6 devices training at once, updates up to 4 versions stale, weighted \(1 \+ staleness\)\^-0\.5/);
  assert.match(await page.locator('#run-settings').textContent(), /4 updates per buffer/);
  assert.match(await page.locator('#run-settings').textContent(), /uploads int8 \(block 256\), model downloaded in f16/);
  assert.match(await page.locator('#run-settings').textContent(), /every 3 versions and the last/);
  // The Stale column holds each buffer's count, newest first, as the admin API reports them.
  const staleColumn = await page.locator('#rounds tbody tr td:nth-child(8)').allTextContents();
  const expected = [...rounds].sort((a, b) => b.round_idx - a.round_idx).map((r) => String(r.n_stale));
  assert.deepEqual(staleColumn, expected);
  await page.screenshot({ path: join(artifacts, 'asynchronous-run.png'), fullPage: true });
  await page.close();
});

test('a run the coordinator stopped says why, in the list and on its page', async () => {
  // No device joins its population: its rounds fail, and after two in a row it stops.
  const plan = {
    model: { schema: { tensors: [{ name: 'w', shape: [8], dtype: 'f32' }] }, init: { kind: 'seeded', seed: 1 } },
    population: 'nobody', cohort_size: 2, min_quorum: 2, over_selection: 1.0,
    selection_timeout_secs: 0.2, reporting_timeout_secs: 0.4, rounds: 5, max_failed_rounds: 2,
  };
  const created = await fetch(`${base}/v1/admin/runs`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${token}`, 'Content-Type': 'application/json' },
    body: JSON.stringify(plan),
  }).then((r) => r.json());
  const stopped = await waitFor('the run to stop', async () => {
    const view = await admin(`/v1/admin/runs/${created.id}`);
    return view.status === 'stopped' && view;
  });
  assert.match(stopped.stop_reason, /2 rounds in a row failed/);
  const page = await browser.newPage();
  await page.goto(`${base}/dashboard/`);
  await page.fill('#token', token);
  await page.click('#login-button');
  const row = page.locator(`#runs tbody tr[data-run-id="${created.id}"]`);
  await row.waitFor();
  assert.equal(await row.locator('td').nth(2).getAttribute('title'), stopped.stop_reason);
  await row.click();
  const reason = page.locator('#run-stop-reason');
  await reason.waitFor({ state: 'visible' });
  assert.equal(await reason.textContent(), `Stopped by the coordinator: ${stopped.stop_reason}`);
  await page.screenshot({ path: join(artifacts, 'stopped-run.png'), fullPage: true });
  await page.close();
});
