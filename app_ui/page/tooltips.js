// Each statistics row's name explains itself when pointed at or tapped (its data-help, which page.css
// shows): ROW_HELP is app_ui/components.py's {row name: words}, put in by components.tooltips().
// The rows are redrawn while an answer streams, so they are labelled again after every change.
() => {
  const help = ROW_HELP;
  const label = () => document.querySelectorAll('.stats tr').forEach((row) => {
    const cell = row.cells[0];
    const words = help[cell?.textContent.trim()];
    if (words && cell.dataset.help !== words) cell.dataset.help = words;
  });
  new MutationObserver(label).observe(document.body, { childList: true, subtree: true });
  label();
}
