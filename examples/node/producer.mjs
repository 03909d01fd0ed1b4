// mlxq from Node.js: enqueue one job, stream its text from the job's channel, read the result.
//   npm install redis@4 @msgpack/msgpack
//   MLXQ_REDIS_URL=redis://localhost:6379/0 MLXQ_MODEL=tiny node producer.mjs "Once upon a time" 16
// MLXQ_TIMEOUT_S=30: the job ends with finish_reason "timeout" and its text so far once it has run 30 s.
// MLXQ_DEFER_S=60 queues it a minute from now; MLXQ_EXPIRES_IN=300 ends it "expired" if not started in
// 5 minutes; MLXQ_WEBHOOK=https://... is called when it ends (a host the operator allowed).
// Structured output: a JSON Schema as the third argument constrains the text to JSON valid for it:
//   node producer.mjs "Triage: the printer is on fire" 200 '{"type": "object", "properties": {...}}'
// It calls mlxq's Redis Functions (library "mlxq", loaded by every worker at start): no script to ship.
import { createClient, commandOptions } from "redis";
import { encode, decode } from "@msgpack/msgpack";
import { createHash, randomBytes } from "node:crypto";

const env = process.env;
const model = env.MLXQ_MODEL ?? "tiny";
const [prompt = "Once upon a time", maxTokens = "16", schema] = process.argv.slice(2);
const base = `mlxq:{mlxq:${model}}`; // every key of one model shares this hash tag
const id = randomBytes(16).toString("hex"); // 32 hex digits, never guessable
const k = { queue: `${base}:queue`, job: `${base}:job:${id}`, counts: `${base}:counts`, wake: `${base}:wake`,
            intake: `${base}:intake`, keyCopy: `${base}:apikeys`, policy: `${base}:policy`,
            deferred: `${base}:deferred`, expiring: `${base}:expiring`, webhooks: `${base}:webhooks`,
            events: `${base}:events:${id}`, chan: `${base}:chan:${id}`, done: `${base}:done:${id}` };
// fair shares and quotas between API keys (PROTOCOL.md section 11): the rings, the indexed jobs, their state, usage
const fair = ["high", "normal", "low"].map((t) => `${base}:fair:${t}`).concat([`${base}:fairq`, `${base}:fair`,
                                                                                `${base}:usage`]);

const redis = createClient({ url: env.MLXQ_REDIS_URL }); await redis.connect();
const sub = redis.duplicate(); await sub.connect();

// Deltas {n: index of the first token id, c: offset of the text, t: text, i: token ids, f: finish reason,
// e: error}: keep one copy of each token index and each character, whatever the attempt.
// (c counts characters, i.e. code points: Array.from, not String.length, which counts UTF-16 units)
let tokens = 0, chars = 0, text = "", end;
const ended = new Promise((resolve) => (end = resolve));
function feed(d) {
  if (d.n > tokens || d.c > chars) return true; // a gap: read the durable stream
  const t = Array.from(d.t).slice(chars - d.c);
  tokens = Math.max(tokens, d.n + d.i.length); chars += t.length; text += t.join("");
  process.stdout.write(t.join(""));
  if (d.f) end(d);
  return false;
}
// A finished job's record keeps its token ids as a string, one character an id (ids from 0xD800 up: + 0x800)
const ids = (v) => typeof v === "string" ? Array.from(v, (c) => { const p = c.codePointAt(0); return p >= 0xD800 ? p - 0x800 : p; }) : v ?? [];
async function replay() { // the durable stream holds every delta and terminal event
  const entries = await redis.xRange(commandOptions({ returnBuffers: true }), k.events, "-", "+");
  for (const { message: m } of entries) {
    if (m.d) feed(decode(m.d));
    else end({ f: m.f.toString(), e: m.e?.toString() }); // cancelled or dead, written by a script
  }
  if (entries.length) return;
  // no stream: a job that ended had it compacted into its record (field "events"); its text is the result's
  const [events, packed] = await redis.hmGet(commandOptions({ returnBuffers: true }), k.job, ["events", "result"]);
  if (events && packed) {
    const r = decode(packed);
    feed({ n: 0, c: 0, t: r.text, i: ids(r.token_ids), f: r.finish_reason });
  }
}
// 1. Subscribe before enqueueing: pub/sub is at-most-once.
await sub.subscribe(k.chan, (msg) => {
  if (msg.toString() === "sync" || feed(decode(msg))) replay();
}, true);

// 2. Enqueue atomically with mlxq's function. It gets the sha256 of the API key, never a tier:
//    Redis decides the tier and the score (an unknown or revoked key is refused there).
const keyHash = env.MLXQ_API_KEY ? createHash("sha256").update(env.MLXQ_API_KEY).digest("hex") : "";
const fields = { id, model, prompt, max_tokens: Number(maxTokens), temperature: 0, source: "node",
                 submitted_at: Date.now() / 1000 };
if (env.MLXQ_TIMEOUT_S) fields.timeout_s = Number(env.MLXQ_TIMEOUT_S); // > 0, or the job is refused
const now = Date.now() / 1000; // run_at and expires_at: epoch seconds, the same in the request and the call
if (env.MLXQ_DEFER_S) fields.run_at = now + Number(env.MLXQ_DEFER_S);
if (env.MLXQ_EXPIRES_IN) fields.expires_at = now + Number(env.MLXQ_EXPIRES_IN); // after run_at, or refused
if (env.MLXQ_WEBHOOK) fields.webhook = env.MLXQ_WEBHOOK;
if (schema) fields.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
const request = Buffer.from(encode(fields));
const life = ["run_at", "expires_at", "webhook"].map((f) => fields[f] === undefined ? "" : String(fields[f]));
const [status, , why] = (await redis.sendCommand(["FCALL", "mlxq_enqueue", "17", k.job, k.counts, k.wake, k.job,
  k.intake, k.queue, k.keyCopy, k.policy, k.deferred, k.expiring, k.webhooks, ...fair,
  id, request, keyHash, "", "0", "86400", ...life])).map(String);
// overload: the tier's queue is full; quota: the key's daily tokens are used up (`why`: seconds to the
// next UTC day); unauthorized: `why` says which key rule; unsynced: no worker yet; invalid_time: `why`
// says which time (expires_at past, or not after run_at)
if (status !== "ok") throw new Error(`enqueue refused: ${status} ${why}`);
const tier = String(await redis.hGet(k.job, "tier"));

// 4. Stream until the final delta, then read the result record.
const last = await ended;
const job = await redis.hGetAll(commandOptions({ returnBuffers: true }), k.job);
const result = job.result ? decode(job.result) : { finish_reason: last.f, error: last.e };
const parsed = schema && result.finish_reason === "stop" ? JSON.parse(result.text) : undefined; // throws if not JSON
console.log("\n" + JSON.stringify({ id, tier, streamed: text, text: result.text, token_ids: ids(result.token_ids),
                                    finish_reason: result.finish_reason, error: result.error, parsed,
                                    usage: result.stats && { prompt_tokens: result.stats.prompt_tokens,
                                                             completion_tokens: result.stats.generated_tokens } }));
await sub.quit(); await redis.quit();
