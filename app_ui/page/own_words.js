// Gradio refuses some files in the page itself, in its words ("Invalid file type: notes.txt. Only
// image allowed.", "File(s) exceed the maximum allowed size of 20.0 Mb: "big.png""), as red errors.
// Those notices are rewritten in the app's words, the server's for the same refusals (engine/images.py):
// the file named, what the chat takes, sizes in MB as the app writes them; shown as the app's other
// notices about a file (a warning: nothing went wrong, the file is not added). FORMATS and LIMIT_MB
// are put in by components.own_words().
() => {
  const sizes = new Map();  // file name -> bytes, of the files chosen, dropped or pasted lately
  const note = (files) => Array.from(files || []).forEach((file) => sizes.set(file.name, file.size));
  document.addEventListener('change', (event) => note(event.target.files), true);
  document.addEventListener('drop', (event) => note(event.dataTransfer?.files), true);
  document.addEventListener('paste', (event) => note(event.clipboardData?.files), true);
  const type = /^Invalid file types?: (.+)\. Only .+ allowed\.$/;
  const size = /^File\(s\) exceed the maximum allowed size of [^:]+: (.+)$/;
  const said = (text) => {
    let found = text.match(type);
    if (found) return `${found[1]}: not a picture; the chat takes images (FORMATS) of up to LIMIT_MB MB each.`;
    found = text.match(size);
    if (!found) return null;
    return found[1].split(/", "/).map((name) => name.replace(/^"|"$/g, '')).map((name) => {
      const bytes = sizes.get(name);
      return `${name}: ${bytes ? (bytes / 1e6).toFixed(1) + ' MB is' : 'it is'} over the upload limit of LIMIT_MB MB.`;
    }).join(' ');
  };
  const rewrite = () => document.querySelectorAll('.toast-message-text').forEach((item) => {
    const words = said(item.textContent.trim());
    if (!words) return;
    item.textContent = words;
    const toast = item.closest('.toast-body');
    toast.querySelectorAll('.error').forEach((part) => part.classList.replace('error', 'warning'));
    toast.classList.replace('error', 'warning');
    const title = toast.querySelector('.toast-title');
    if (title?.firstChild) title.firstChild.textContent = 'Warning ';
  });
  new MutationObserver(rewrite).observe(document.body, { childList: true, subtree: true, characterData: true });
}
