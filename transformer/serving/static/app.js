// The translation page: POST /v1/translate with the lines of the text box, list the translations
// and their alternatives, and draw the cross-attention of the chosen one (POST /v1/align) as a table
// whose cells are shaded by weight. A many-to-many model (/health lists its target_languages) gets a
// choice of the language to translate into. Plain JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
let chosen = null; // {source, translation, element}: the sentence pair the heatmap shows

// The target language field of a request: the chosen one for a many-to-many model, none otherwise.
const target = () => ($("target").hidden ? {} : { target_lang: $("target_lang").value });

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  if (!response.ok) throw new Error(answer.error || response.statusText);
  return answer;
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function translate() {
  const lines = $("source").value.split("\n").map((s) => s.trim()).filter((s) => s);
  if (!lines.length) return status("Type a sentence first.", true);
  const beam = Number($("beam").value), nbest = Math.min(Number($("nbest").value), beam);
  $("translate").disabled = true;
  status("Translating…");
  try {
    const answer = await post("/v1/translate", { text: lines, beam_size: beam, n_best: nbest, ...target() });
    showTranslations(lines, answer);
    status(`${lines.length} sentence(s) in ${Math.round(answer.timing.total_ms)} ms`);
    $("translations").querySelector(".choice").click();
  } catch (error) {
    status(error.message, true);
  } finally {
    $("translate").disabled = false;
  }
}

function choice(source, translation, score) {
  const span = document.createElement("span");
  span.className = "choice";
  span.textContent = translation || "(empty)";
  span.addEventListener("click", () => align(source, translation, span));
  if (score !== undefined) {
    const s = document.createElement("span");
    s.className = "score";
    s.textContent = score.toFixed(2);
    span.append(s);
  }
  return span;
}

function showTranslations(lines, answer) {
  const list = $("translations");
  list.replaceChildren();
  lines.forEach((source, i) => {
    const item = document.createElement("li");
    item.append(choice(source, answer.translations[i]));
    const alternatives = document.createElement("ul");
    alternatives.className = "alternatives";
    for (const alt of (answer.n_best || [])[i] || []) {
      const li = document.createElement("li");
      li.append(choice(source, alt.translation, alt.score));
      alternatives.append(li);
    }
    item.append(alternatives);
    list.append(item);
  });
}

async function align(source, translation, element) {
  chosen = { source, translation, element };
  document.querySelectorAll(".choice.selected").forEach((e) => e.classList.remove("selected"));
  element.classList.add("selected");
  try {
    const layer = Number($("layer").value || -1);
    drawHeatmap(await post("/v1/align", { text: source, translation, layer, ...target() }));
  } catch (error) {
    status(error.message, true);
  }
}

function drawHeatmap(answer) {
  const table = $("heatmap");
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  head.append(document.createElement("th"));
  for (const token of answer.source_tokens) {
    const th = document.createElement("th");
    th.textContent = token;
    head.append(th);
  }
  const body = table.createTBody();
  answer.weights.forEach((row, i) => {
    const tr = body.insertRow();
    const th = document.createElement("th");
    th.textContent = answer.target_tokens[i];
    tr.append(th);
    row.forEach((weight, j) => {
      const td = tr.insertCell();
      td.style.background = `rgba(36, 54, 79, ${weight.toFixed(3)})`;
      td.title = `${answer.target_tokens[i]} → ${answer.source_tokens[j]}: ${weight.toFixed(3)}`;
    });
  });
  $("layer").value = String(answer.layer);
  $("alignment").hidden = false;
}

async function start() {
  const health = await (await fetch("/health")).json();
  const languages = health.target_languages || [];
  const name = health.language_pair || (languages.length ? `into ${languages.join(", ")}` : "model");
  $("model").textContent = `${name} on ${health.device}`;
  for (const lang of languages) $("target_lang").add(new Option(lang, lang));
  $("target").hidden = languages.length === 0;
  $("beam").max = $("nbest").max = health.limits.max_beam_size;
  for (let i = 0; i < health.decoder_layers; i++) $("layer").add(new Option(`${i + 1} of ${health.decoder_layers}`, i));
  $("layer").value = String(health.decoder_layers - 1);
  $("layer").addEventListener("change", () => chosen && align(chosen.source, chosen.translation, chosen.element));
  $("translate").addEventListener("click", translate);
}

start();
