// The official OpenAI SDK (npm `openai`, pinned in package-lock.json) against a running
// `kvtier-engine serve` (started by tests/serving/serve_e2e_test.cc, OfficialOpenAiSdk).
//   KVTIER_SERVE_URL   http://127.0.0.1:PORT/v1
//   KVTIER_KEY_A       API key of tenant A;  KVTIER_KEY_B  API key of tenant B
// The server runs with --idle-sequences-max 0, so turn 2 is resumed from kvtierd.
// Exit code 0 when every check passed; each failure is printed.
import OpenAI from "openai";

const baseURL = process.env.KVTIER_SERVE_URL;
const a = new OpenAI({ baseURL, apiKey: process.env.KVTIER_KEY_A, maxRetries: 0 });
const b = new OpenAI({ baseURL, apiKey: process.env.KVTIER_KEY_B, maxRetries: 0 });
const model = "kvmini-trained";
let failures = 0;
function check(ok, what) {
  if (!ok) {
    failures++;
    console.error("FAIL: " + what);
  }
}

const question = "a page of the cache tier holds sixty-four tokens of the kv of a unit ".repeat(3);
const messages = [{ role: "user", content: question }];

// Two turns: the second reports every token of the first turn as cached.
const t1 = await a.chat.completions.create({ model, messages, max_tokens: 20, temperature: 0 });
const p1 = t1.usage.prompt_tokens, c1 = t1.usage.completion_tokens;
const reply = t1.choices[0].message.content;
check(t1.usage.prompt_tokens_details.cached_tokens === 0, "turn 1 cached_tokens is 0");
check(Buffer.byteLength(reply) === c1, "turn 1 reply is all byte tokens");
const t2 = await a.chat.completions.create({
  model,
  messages: [...messages, { role: "assistant", content: reply }, { role: "user", content: "so?" }],
  max_tokens: 4,
  temperature: 0,
});
// Every token of turn 1 the engine computed: its whole units plus the hot state's partial page.
const whole = p1 + c1 - 1;
check(whole > 0 && t2.usage.prompt_tokens_details.cached_tokens === whole,
      `turn 2 cached_tokens ${t2.usage.prompt_tokens_details.cached_tokens} == ${whole}`);
check(t2.usage.prompt_cache_hit_tokens === whole, "prompt_cache_hit_tokens (DeepSeek's name)");
check(t2.usage.prompt_cache_hit_tokens + t2.usage.prompt_cache_miss_tokens === t2.usage.prompt_tokens,
      "hit + miss == prompt_tokens");

// Streaming with usage (tenant B: computed like turn 1, so the text must match it).
const stream = await b.chat.completions.create({
  model, messages, max_tokens: 20, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
let text = "", usage = null, finish = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    text += c.delta?.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
  }
}
check(text === reply, "streamed text equals the non-streamed reply");
check(finish === "length", "finish_reason length");
check(usage && usage.completion_tokens === 20 && usage.prompt_tokens === p1, "stream usage");
check(usage && usage.prompt_tokens_details.cached_tokens === 0, "tenant B never hits A's cache");

// Legacy completions and the SDK's typed errors.
const comp = await a.completions.create({ model, prompt: question, max_tokens: 3, temperature: 0 });
check(comp.usage.completion_tokens === 3 && comp.choices.length === 1, "completions");
const models = await a.models.list();
check(models.data.some((m) => m.id === model), "models.list");
try {
  await a.chat.completions.create({ model: "gpt-nope", messages, max_tokens: 1 });
  check(false, "unknown model must fail");
} catch (e) {
  check(e instanceof OpenAI.NotFoundError && e.code === "model_not_found", "404 model_not_found");
}
try {
  await new OpenAI({ baseURL, apiKey: "sk-wrong", maxRetries: 0 }).models.list();
  check(false, "bad key must fail");
} catch (e) {
  check(e instanceof OpenAI.AuthenticationError, "401 for a bad key");
}
try {
  await a.chat.completions.create({ model, messages, max_tokens: 1, temperature: "hot" });
  check(false, "bad temperature must fail");
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === "temperature", "400 names the param");
}
console.log(failures === 0 ? "openai sdk: all checks passed" : `openai sdk: ${failures} failures`);
process.exit(failures === 0 ? 0 : 1);
