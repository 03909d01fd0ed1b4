// mlxq from Node.js: enqueue one job, stream its text from the job's channel, read the result.
//   npm install redis@4 @msgpack/msgpack
//   MLXQ_REDIS_URL=redis://localhost:6379/0 MLXQ_MODEL=tiny MLXQ_ENQUEUE_LUA=enqueue.lua node producer.mjs "Once upon a time" 16
// enqueue.lua ships with mlxq: python -c "import mlxq.shared, pathlib; print(pathlib.Path(mlxq.shared.__file__).parent / 'lua/enqueue.lua')"
import { createClient, commandOptions } from "redis";
import { encode, decode } from "@msgpack/msgpack";
import { createHash, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";

const env = process.env;
const model = env.MLXQ_MODEL ?? "tiny";
const [prompt = "Once upon a time", maxTokens = "16"] = process.argv.slice(2);
const base = `mlxq:{mlxq:${model}}`; // every key of one model shares this hash tag
const id = randomBytes(16).toString("hex"); // 32 hex digits, never guessable
const k = { queue: `${base}:queue`, job: `${base}:job:${id}`, counts: `${base}:counts`, wake: `${base}:wake`,
            events: `${base}:events:${id}`, chan: `${base}:chan:${id}`, done: `${base}:done:${id}` };

const redis = createClient({ url: env.MLXQ_REDIS_URL }); await redis.connect();
const sub = redis.duplicate(); await sub.connect();

// Deltas {a: attempt, s: seq, t: text, i: token ids, f: finish reason, e: error}, in order, each once.
let attempt = 0, next = 1, text = "", end;
const ended = new Promise((resolve) => (end = resolve));
function feed(d) {
  if (d.a > attempt) [attempt, next, text] = [d.a, 1, ""]; // a new attempt streams from the start
  if (d.a !== attempt || d.s !== next) return d.a === attempt && d.s > next; // true: a gap
  next += 1; text += d.t; process.stdout.write(d.t);
  if (d.f) end(d);
  return false;
}
async function replay() { // the durable stream holds every delta and terminal event
  const entries = await redis.xRange(commandOptions({ returnBuffers: true }), k.events, "-", "+");
  for (const { message: m } of entries) {
    if (m.d) feed(decode(m.d));
    else end({ f: m.f.toString(), e: m.e?.toString() }); // cancelled or dead, written by a script
  }
}
// 1. Subscribe before enqueueing: pub/sub is at-most-once.
await sub.subscribe(k.chan, (msg) => {
  if (msg.toString() === "sync" || feed(decode(msg))) replay();
}, true);

// 2. The tier comes from the API key's registry entry (sha256 of the key); no key or no keys: normal.
async function tierOf(apiKey) {
  if (!apiKey) return "normal";
  const tier = await redis.hGet("mlxq:apikeys", createHash("sha256").update(apiKey).digest("hex"));
  if (tier === null && !(await redis.exists("mlxq:apikeys"))) return "normal"; // open mode
  if (!["high", "normal", "low"].includes(tier)) throw new Error("unknown or revoked API key");
  return tier;
}
const tier = await tierOf(env.MLXQ_API_KEY);
const offset = { high: 0, normal: 30, low: 300 }[tier]; // seconds added to the score (MLXQ_TIER_OFFSETS)

// 3. Enqueue atomically with mlxq's script.
const request = Buffer.from(encode({ id, model, prompt, max_tokens: Number(maxTokens), temperature: 0,
                                     source: "node", submitted_at: Date.now() / 1000 }));
const [status] = await redis.sendCommand(["EVAL", readFileSync(env.MLXQ_ENQUEUE_LUA, "utf8"), "5",
  k.queue, k.job, k.counts, k.wake, k.job, id, request, tier, String(offset), "10000", "0", "86400"]);
if (status !== "ok") throw new Error(`enqueue refused: ${status}`); // overload: the tier's queue is full

// 4. Stream until the final delta, then read the result record.
const last = await ended;
const job = await redis.hGetAll(commandOptions({ returnBuffers: true }), k.job);
const result = job.result ? decode(job.result) : { finish_reason: last.f, error: last.e };
console.log("\n" + JSON.stringify({ id, tier, streamed: text, text: result.text, token_ids: result.token_ids,
                                    finish_reason: result.finish_reason, error: result.error,
                                    usage: result.stats && { prompt_tokens: result.stats.prompt_tokens,
                                                             completion_tokens: result.stats.generated_tokens } }));
await sub.quit(); await redis.quit();
