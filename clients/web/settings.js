// How the page looks: transcript or caption mode, text size and theme.
//
// Each choice is a data- attribute on <html> that style.css keys on, and is kept in
// localStorage so that a room screen comes back the way it was set up. `?mode=captions` (or
// `transcript`) in the URL wins over the stored mode, so a bookmark opens a screen in its mode.

const CHOICES = {
  mode: ["transcript", "captions"],
  size: ["s", "m", "l", "xl"],
  theme: ["dark", "light"],
};

function stored(name) {
  try {
    return localStorage.getItem(`captiond.${name}`);
  } catch {
    return null; // storage blocked: the defaults
  }
}

function store(name, value) {
  try {
    localStorage.setItem(`captiond.${name}`, value);
  } catch {
    // Storage blocked: the choice lasts until the page is reloaded.
  }
}

function apply(name, value) {
  document.documentElement.dataset[name] = value;
}

function initial(name, fallback) {
  const wanted = (name === "mode" && new URLSearchParams(location.search).get("mode")) || stored(name);
  return CHOICES[name].includes(wanted) ? wanted : fallback;
}

// Wires the controls: `modeButtons` (one per mode, `data-mode`), the `size` and `theme` selects.
// `onMode(mode)` runs after each switch (the view keeps its place).
export function initSettings({ modeButtons, size, theme, onMode }) {
  const prefersLight = matchMedia("(prefers-color-scheme: light)").matches;
  const setMode = (mode) => {
    apply("mode", mode);
    for (const button of modeButtons) {
      button.setAttribute("aria-pressed", String(button.dataset.mode === mode));
    }
    onMode(mode);
  };
  setMode(initial("mode", "transcript"));
  for (const button of modeButtons) {
    button.addEventListener("click", () => {
      const mode = button.dataset.mode;
      store("mode", mode);
      // A URL that names a mode is updated too, or a reload would switch back.
      const url = new URL(location.href);
      if (url.searchParams.has("mode")) {
        url.searchParams.set("mode", mode);
        history.replaceState(null, "", url);
      }
      setMode(mode);
    });
  }
  for (const [name, select, fallback] of [
    ["size", size, "m"],
    ["theme", theme, prefersLight ? "light" : "dark"],
  ]) {
    select.value = initial(name, fallback);
    apply(name, select.value);
    select.addEventListener("change", () => {
      store(name, select.value);
      apply(name, select.value);
    });
  }
}
