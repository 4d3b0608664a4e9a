// Small canvas plots for the engine view: line charts over time, bars per step, and the
// two-lane step timeline. No library: a few dozen lines of 2D canvas each.

export const COLORS = {
  schedule: "#d08c00", prepare: "#7a5fd1", commit: "#2a9d8f", grammar: "#b5487a", "forward+sample": "#2f6fdf",
  running: "#2f6fdf", waiting: "#d08c00", preempted: "#c0392b", used: "#2f6fdf", prefix: "#2a9d8f",
  tps: "#2f6fdf", batch: "#2f6fdf", grid: "rgba(128,128,128,0.25)", text: "#777",
};

/** Match the canvas's pixel buffer to its laid-out size; returns the context and the CSS size. */
function prepare(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const width = Math.max(50, canvas.clientWidth);
  const height = Number(canvas.getAttribute("height"));
  if (canvas.width !== Math.round(width * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.style.height = `${height}px`;
    canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, width, height };
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * magnitude) return step * magnitude;
  return 10 * magnitude;
}

const PAD = { left: 36, right: 36, top: 6, bottom: 16 };

function axes(ctx, width, height, yMax, label, rightMax) {
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  for (let i = 0; i <= 2; i++) {
    const y = PAD.top + (height - PAD.top - PAD.bottom) * (1 - i / 2);
    ctx.beginPath();
    ctx.moveTo(PAD.left, y);
    ctx.lineTo(width - PAD.right, y);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(String(+(yMax * i / 2).toFixed(1)), PAD.left - 4, y + 4);
    if (rightMax !== undefined) {
      ctx.textAlign = "left";
      ctx.fillText(String(+(rightMax * i / 2).toFixed(0)), width - PAD.right + 4, y + 4);
    }
  }
  ctx.textAlign = "left";
  ctx.fillText(label, PAD.left, height - 3);
}

/** Lines over the last `seconds`: series = [{points: [[time, value]], color, right?}] where
 *  `right` series use the right axis (0..rightMax). */
export function lineChart(canvas, series, now, seconds, { yMax, rightMax } = {}) {
  const { ctx, width, height } = prepare(canvas);
  const left = series.filter((s) => !s.right).flatMap((s) => s.points.map((p) => p[1]));
  const top = yMax ?? niceMax(Math.max(0, ...left));
  axes(ctx, width, height, top, `last ${seconds} s`, rightMax);
  const x = (t) => PAD.left + (width - PAD.left - PAD.right) * (1 - (now - t) / seconds);
  const plotH = height - PAD.top - PAD.bottom;
  for (const s of series) {
    const scale = s.right ? rightMax : top;
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.filter((p) => now - p[0] <= seconds).forEach(([t, v], i) => {
      const y = PAD.top + plotH * (1 - Math.min(v, scale) / scale);
      if (i === 0) ctx.moveTo(x(t), y);
      else ctx.lineTo(x(t), y);
    });
    ctx.stroke();
    ctx.lineWidth = 1;
  }
}

/** One bar per value, newest on the right. */
export function barChart(canvas, values, color, label) {
  const { ctx, width, height } = prepare(canvas);
  const top = niceMax(Math.max(0, ...values));
  axes(ctx, width, height, top, label);
  const plotW = width - PAD.left - PAD.right;
  const plotH = height - PAD.top - PAD.bottom;
  const slot = plotW / Math.max(values.length, 1);
  ctx.fillStyle = color;
  values.forEach((v, i) => {
    const h = plotH * (v / top);
    ctx.fillRect(PAD.left + i * slot + slot * 0.1, PAD.top + plotH - h, Math.max(1, slot * 0.8), h);
  });
}

/** Two lanes (host above, device below) of spans in the last `seconds` before `now`. */
export function timeline(canvas, spans, now, seconds) {
  const { ctx, width, height } = prepare(canvas);
  const laneTop = { host: 8, device: 8 + (height - 28) / 2 + 4 };
  const laneH = (height - 28) / 2 - 4;
  const plotW = width - 60;
  const x = (t) => 56 + plotW * (1 - (now - t) / seconds);
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "left";
  ctx.fillText("host", 4, laneTop.host + laneH / 2 + 4);
  ctx.fillText("device", 4, laneTop.device + laneH / 2 + 4);
  for (const s of spans) {
    if (now - s.end > seconds) continue;
    const x0 = Math.max(56, x(s.start));
    const x1 = x(s.end);
    ctx.fillStyle = COLORS[s.name] || "#999";
    ctx.fillRect(x0, laneTop[s.lane], Math.max(1, x1 - x0), laneH);
  }
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  for (let i = 0; i <= seconds; i += seconds > 4 ? 1 : 0.5) {  // a tick per 0.5 s (1 s on long windows)
    const tx = x(now - i);
    ctx.beginPath();
    ctx.moveTo(tx, 4);
    ctx.lineTo(tx, height - 16);
    ctx.stroke();
    ctx.textAlign = "center";
    ctx.fillText(i === 0 ? "now" : `-${i}s`, Math.min(width - 14, tx), height - 3);
  }
}
