#!/usr/bin/env node
// The TypeScript AdCP SDK (@adcp/sdk, pinned in package.json) as a test oracle, one call per batch.
//
//   node adcp_ts.js verify       stdin: {"jwks": {...}, "requests": [{method, url, headers, body_b64}]}
//                                stdout: [{"ok": true, "keyid": ...} | {"ok": false, "code", "step", "message"}]
//   node adcp_ts.js storyboard   stdin: {"agent_url", "jwks_url", "storyboard"}
//                                stdout: the runner's StoryboardResult, as JSON
//
// verify runs the SDK's webhook verifier (verifyWebhookSignature) over every request with one
// shared replay store, as one buyer would. storyboard runs a compliance storyboard from the
// SDK's own cache with its loopback webhook receiver and its verifier, the JWKS fetched from
// jwks_url by the SDK's HttpsJwksResolver (plain http and loopback allowed for the test).
'use strict';

const { verifyWebhookSignature, StaticJwksResolver, HttpsJwksResolver, InMemoryReplayStore,
        InMemoryRevocationStore } = require('@adcp/sdk/signing');
const { runStoryboard, getComplianceStoryboardById } = require('@adcp/sdk/testing');

async function readStdin() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString('utf8'));
}

async function verify({ jwks, requests }) {
  const options = { jwks: new StaticJwksResolver(jwks.keys), replayStore: new InMemoryReplayStore(),
                    revocationStore: new InMemoryRevocationStore() };
  const results = [];
  for (const r of requests) {
    const request = { method: r.method, url: r.url, headers: r.headers,
                      body: Buffer.from(r.body_b64, 'base64').toString('utf8') };
    try {
      const verified = await verifyWebhookSignature(request, options);
      results.push({ ok: true, keyid: verified.keyid });
    } catch (err) {
      results.push({ ok: false, code: err.code ?? err.name, step: err.failedStep ?? null,
                     message: String(err.message ?? err) });
    }
  }
  return results;
}

async function storyboard({ agent_url, jwks_url, storyboard: id }) {
  const board = getComplianceStoryboardById(id);
  if (!board) throw new Error(`no storyboard ${id} in the SDK's compliance cache`);
  return runStoryboard(agent_url, board, {
    protocol: 'mcp',
    allow_http: true,
    webhook_receiver: { mode: 'loopback_mock', host: '127.0.0.1' },
    webhook_signing: { jwks: new HttpsJwksResolver(jwks_url, { allowPrivateIp: true }) },
  });
}

const commands = { verify, storyboard };

(async () => {
  const command = commands[process.argv[2]];
  if (!command) throw new Error(`usage: adcp_ts.js ${Object.keys(commands).join('|')} < input.json`);
  process.stdout.write(JSON.stringify(await command(await readStdin())));
})().then(() => process.exit(0), (err) => {
  process.stderr.write(`adcp_ts.js: ${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
